"""Sharded optimizer state: rvod DistributedOptimizer(sharded=False / True) against torch's
ZeroRedundancyOptimizer (gloo, with DDP reducing the gradients), on 2 and 4 ranks.

    python benches/sharded_optimizer.py [--ranks 2 4] [--width 1024] [--layers 6] [--steps 20] [--rounds 3]

The driver starts one job per contender, world size and round (``rvodrun -np N python THIS --worker
CONTENDER``), one after the other and the contenders alternating within a round, so each job's peak RSS is
its own and a machine busy with something else slows every contender alike; it prints one table, each
number the median over the rounds. Per contender and size:

- peak RSS: the largest ``ru_maxrss`` of the job's ranks (model, gradients, optimizer state, buffers);
- state: bytes of the optimizer's own state tensors on the rank holding the most;
- bytes/step: what one rank sends per step by the collectives the contender issues, counted as their
  bandwidth-optimal algorithms send (allreduce 2(N-1)/N x L, reducescatter and allgather (N-1)/N x L each,
  ZeroRedundancyOptimizer's broadcast of each rank's partition (N-1)/N x L on average), L the bytes of
  the parameters; relative to one allreduce;
- step time: the median over the timed steps of the slower rank, a step timed from its start to the next
  one's (forward, backward, reduction, step, and whatever of the step's communication is still running
  when the next one starts: a sharded optimizer's allgather overlaps the next forward).

The model is an MLP of ``--layers`` square layers trained with Adam, so its state (two copies of the
parameters) dominates memory.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

CONTENDERS = ("rvod", "rvod-sharded", "zero-gloo")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="jobs per contender and size (median reported)")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    return parser.parse_args()


def state_bytes(state):
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values()
               if hasattr(v, "numel") and v.dim() > 0)


def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn

    import rvod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if args.worker == "zero-gloo":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        port = hvd.broadcast_object(port if rank == 0 else None, root_rank=0, name="bench.port")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        state = lambda: optimizer.optim.state  # noqa: E731
        barrier = dist.barrier
    else:
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                             named_parameters=model.named_parameters(),
                                             sharded=args.worker == "rvod-sharded")
        state = lambda: optimizer.state  # noqa: E731
        barrier = hvd.barrier
    x = torch.randn(args.batch_size, args.width)
    barrier()
    starts = []
    for _ in range(args.warmup + args.steps):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    getattr(optimizer, "wait_for_parameters", lambda: None)()  # the last step's allgather
    starts.append(time.perf_counter())
    times = [b - a for a, b in zip(starts[args.warmup:], starts[args.warmup + 1:])]
    slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="bench.times")
    report = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "state": state_bytes(state())}
    everyone = hvd.allgather_object(report, name="bench.report")
    if rank == 0:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        print(json.dumps({"contender": args.worker, "size": size, "params": params,
                          "rss": max(r["rss"] for r in everyone), "state": max(r["state"] for r in everyone),
                          "step": statistics.median(slowest.tolist())}), flush=True)
    if args.worker == "zero-gloo":
        dist.destroy_process_group()


def wire_bytes(contender, size, params):
    """What one rank sends per step, by the bandwidth-optimal algorithms of the collectives issued."""
    share = (size - 1) / size * params
    return {"rvod": 2 * share, "rvod-sharded": share + share, "zero-gloo": 2 * share + share}[contender]


def driver(args):
    runs = {}
    for size in args.ranks:
        for _ in range(args.rounds):
            for contender in CONTENDERS:
                command = [sys.executable, "-m", "rvod.runner", "-np", str(size), sys.executable,
                           os.path.abspath(__file__), "--worker", contender, "--width", str(args.width), "--layers",
                           str(args.layers), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                           "--warmup", str(args.warmup)]
                result = subprocess.run(command, capture_output=True, text=True, timeout=900)
                lines = [line.split(">:", 1)[-1] for line in result.stdout.splitlines() if '"contender"' in line]
                if result.returncode or not lines:
                    raise SystemExit(f"{contender} on {size} ranks failed:\n{result.stdout}\n{result.stderr}")
                runs.setdefault((size, contender), []).append(json.loads(lines[-1]))
    rows = [{**found[0], **{key: statistics.median(r[key] for r in found) for key in ("rss", "state", "step")},
             "steps": [round(r["step"] * 1e3, 1) for r in found]} for found in runs.values()]
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), Adam, batch {args.batch_size} per rank; "
          f"median of {args.steps} steps, median of {args.rounds} rounds")
    header = (f"{'ranks':>5} {'contender':<13} {'peak RSS MiB':>12} {'state MiB/rank':>14} {'x unsharded':>11} "
              f"{'bytes/step MiB':>14} {'x allreduce':>11} {'step ms':>8} {'x rvod':>7}")
    print(header)
    for size in args.ranks:
        base = {r["contender"]: r for r in rows if r["size"] == size}
        for contender in CONTENDERS:
            row = base[contender]
            wire = wire_bytes(contender, size, row["params"])
            print(f"{size:>5} {contender:<13} {row['rss'] / 2**20:>12.0f} {row['state'] / 2**20:>14.1f} "
                  f"{row['state'] / base['rvod']['state']:>11.3f} {wire / 2**20:>14.1f} "
                  f"{wire / wire_bytes('rvod', size, row['params']):>11.2f} {row['step'] * 1e3:>8.1f} "
                  f"{row['step'] / base['rvod']['step']:>7.2f}  rounds: {row['steps']}")


if __name__ == "__main__":
    arguments = parse_args()
    worker(arguments) if arguments.worker else driver(arguments)
