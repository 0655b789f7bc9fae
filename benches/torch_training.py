"""rvod.torch's DistributedOptimizer against PyTorch DDP (gloo), side by side in the same two processes.

    rvodrun -np 2 python benches/torch_training.py [--rounds 5]

Both ranks hold an rvod engine and a gloo process group at once and, with one thread each, alternate
between the contenders in every round (rvod, DDP, then rank 0 alone for the one-process baseline while
rank 1 waits), so machine noise hits all of them alike. Measured:

(a) training step time of the synthetic-benchmark model (examples/torch_synthetic_benchmark.py) and of a
    communication-heavy MLP: rvod / DDP per round, and scaling efficiency E(2) = rate(2) / (2 x rate(1)) =
    t(1) / t(2) for both (same batch per rank, so t(1) is one process training on its batch alone);
(b) 1,024 float32 tensors of 4 KiB: rvod allreduce_async_ of each then synchronize, against gloo
    all_reduce(async_op=True) of each then wait.

Every time is the slower rank's. Printed: each round, then the median of the per-round ratios with their
min-max.
"""

import argparse
import importlib.util
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import rvod.torch as hvd

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_synthetic_benchmark.py"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per contender and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed block")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--width", type=int, default=32, help="width of the synthetic-benchmark model")
    parser.add_argument("--mlp-width", type=int, default=1024, help="hidden width of the MLP (4 layers)")
    parser.add_argument("--tensors", type=int, default=1024, help="small tensors in (b)")
    parser.add_argument("--tensor-bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions of (b) per round")
    return parser.parse_args()


def synthetic_benchmark_model(width, batch_size):
    """(model factory, images, labels) for the model of examples/torch_synthetic_benchmark.py."""
    spec = importlib.util.spec_from_file_location("torch_synthetic_benchmark", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    images, labels = module.synthetic_batch(batch_size, 32, seed=hvd.rank())
    return (lambda: module.SmallResNet(width)), images, labels


def mlp_model(width, batch_size):
    """(model factory, inputs, labels) for a 4-layer MLP: much communication for little computation."""
    generator = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(batch_size, width, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)

    def build():
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    return build, x, y


def slowest(seconds):
    """The largest of every rank's ``seconds`` (exchanged outside any timed region)."""
    return max(hvd.allgather_object(seconds, name="bench.seconds"))


def time_steps(model, optimizer, x, y, barrier, warmup, steps):
    """Seconds per training step, after ``warmup`` untimed steps and a barrier."""

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


class Contenders:
    """One model per contender, all starting from the same weights."""

    def __init__(self, build, warmup, steps):
        self.timing = {"warmup": warmup, "steps": steps}
        torch.manual_seed(0)
        reference = build()
        self.rvod_model, self.ddp_model, self.local_model = build(), build(), build()
        for model in (self.rvod_model, self.ddp_model, self.local_model):
            model.load_state_dict(reference.state_dict())
        def sgd(model):
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        self.rvod_optimizer = hvd.DistributedOptimizer(sgd(self.rvod_model),
                                                       named_parameters=self.rvod_model.named_parameters())
        self.ddp_wrapper = DistributedDataParallel(self.ddp_model)
        self.ddp_optimizer = sgd(self.ddp_model)
        self.local_optimizer = sgd(self.local_model)

    def rvod(self, x, y):
        return slowest(time_steps(self.rvod_model, self.rvod_optimizer, x, y, hvd.barrier, **self.timing))

    def ddp(self, x, y):
        return slowest(time_steps(self.ddp_wrapper, self.ddp_optimizer, x, y, dist.barrier, **self.timing))

    def one_process(self, x, y):
        """Rank 0 trains alone while the other ranks wait in a barrier."""
        seconds = 0.0
        if hvd.rank() == 0:
            seconds = time_steps(self.local_model, self.local_optimizer, x, y, lambda: None, **self.timing)
        hvd.barrier()
        return slowest(seconds)


def summary(label, values):
    return f"{label} median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


def training(args, name, build, x, y):
    contenders = Contenders(build, args.warmup, args.steps)
    params = sum(p.numel() for p in contenders.rvod_model.parameters())
    log(f"\n(a) training step, {name}: {params / 1e6:.2f} M parameters ({params * 4 / 2**20:.1f} MiB of gradients), "
        f"batch {args.batch_size} per rank, {args.steps} timed steps per contender and round")
    ratios, rvod_eff, ddp_eff = [], [], []
    for round_index in range(args.rounds):
        t_rvod = contenders.rvod(x, y)
        t_ddp = contenders.ddp(x, y)
        t_one = contenders.one_process(x, y)
        ratios.append(t_rvod / t_ddp)
        rvod_eff.append(t_one / t_rvod)
        ddp_eff.append(t_one / t_ddp)
        log(f"  round {round_index}: step rvod {t_rvod * 1e3:7.1f} ms, DDP(gloo) {t_ddp * 1e3:7.1f} ms, "
            f"one process {t_one * 1e3:7.1f} ms; rvod/DDP {ratios[-1]:.3f}; "
            f"E(2) rvod {rvod_eff[-1]:.3f}, DDP {ddp_eff[-1]:.3f}")
    log("  " + summary("step time rvod/DDP", ratios))
    log("  " + summary("E(2) rvod", rvod_eff) + "; " + summary("E(2) DDP", ddp_eff))


def small_tensors(args):
    count = args.tensor_bytes // 4
    rvod_tensors = [torch.ones(count) for _ in range(args.tensors)]
    gloo_tensors = [torch.ones(count) for _ in range(args.tensors)]
    names = [f"small.{i}" for i in range(args.tensors)]

    def rvod_once():
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(rvod_tensors, names)]
        for handle in handles:
            hvd.synchronize(handle)

    def gloo_once():
        works = [dist.all_reduce(t, async_op=True) for t in gloo_tensors]
        for work in works:
            work.wait()

    def timed(once, barrier):
        once()  # warm-up (and, for rvod, fills the response cache)
        samples = []
        for _ in range(args.repeats):
            barrier()
            start = time.perf_counter()
            once()
            samples.append(time.perf_counter() - start)
        return slowest(statistics.median(samples))

    log(f"\n(b) {args.tensors} float32 tensors of {args.tensor_bytes} B, submitted asynchronously then waited for; "
        f"median of {args.repeats} repetitions per round")
    ratios = []
    for round_index in range(args.rounds):
        t_rvod = timed(rvod_once, hvd.barrier)
        t_gloo = timed(gloo_once, dist.barrier)
        ratios.append(t_rvod / t_gloo)
        log(f"  round {round_index}: rvod {t_rvod * 1e3:8.2f} ms, gloo {t_gloo * 1e3:8.2f} ms, "
            f"rvod/gloo {ratios[-1]:.3f}")
    log("  " + summary("time rvod/gloo", ratios))


def init_gloo():
    """A gloo process group beside rvod, its port chosen by rank 0 and shared through rvod."""
    port = None
    if hvd.rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="bench.gloo.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())


def main():
    args = parse_args()
    # (b) alone names 1,024 tensors, and the models add their parameters: more names than the response
    # cache's default 1,024 entries, which an LRU cache then misses on every lookup. Size it for the run.
    os.environ.setdefault("RVOD_CACHE_CAPACITY", "4096")
    hvd.init()
    torch.set_num_threads(1)
    if hvd.size() != 2:
        raise SystemExit("run with 2 ranks: rvodrun -np 2 python benches/torch_training.py")
    init_gloo()
    log(f"rvod.torch vs DDP(gloo): 2 ranks, 1 thread each, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{args.rounds} alternating rounds")
    training(args, f"SmallResNet(width={args.width}) on 32x32 images",
             *synthetic_benchmark_model(args.width, args.batch_size))
    training(args, f"MLP 4 x {args.mlp_width}", *mlp_model(args.mlp_width, args.batch_size))
    small_tensors(args)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
