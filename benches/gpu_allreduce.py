"""Allreduce of CUDA tensors: rvod (rvod.torch, host staging) vs torch.distributed gloo on the same CUDA
tensors, 2 ranks sharing one GPU (issue 30; run by scripts/gpu-check.sh on a lent GPU machine).

    python benches/gpu_allreduce.py [--out gpu-bench.json] [--ranks 2] [--rounds 5] [--sizes 4,4096,...]
                                    [--iters 20]

Both implementations stage through host memory here (NCCL refuses two ranks on one GPU, and gloo copies CUDA
tensors to the host), so this compares like with like: the same ranks, tensors, sizes and timing, one job per
implementation, in turn, for ``--rounds`` alternating rounds. Each job times, per size, in-place float32
allreduces of a tensor on ``cuda:local_rank % device_count`` after warm-ups, with ``torch.cuda.synchronize()``
before the clock stops (rank 0's mean per call; RVOD_BENCH_DEVICE=cpu: a dry run on CPU tensors). Reported:
microseconds per call (medians over rounds), busbw, and rvod's time over gloo's (the median of per-round
ratios; below 1 is faster). Also times 1 rank alone, the GPU its own, on rvod's NCCL route as it completes ops by
default (once their work has run) and with RVOD_ENABLE_ASYNC_COMPLETION=1 (once it is queued), against
torch.distributed's NCCL backend on 1 rank (which queues and returns): the difference is what rvod adds to an
op. Prints a table and writes JSON.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [4, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def worker(impl: str, sizes: list[int], iters: int) -> None:
    import torch

    if impl == "rvod":
        import rvod.torch as hvd

        hvd.init()
        rank, size, local = hvd.rank(), hvd.size(), hvd.local_rank()

        def allreduce(tensor, name):
            hvd.allreduce_(tensor, op=hvd.Sum, name=name)
    else:  # torch.distributed: "gloo" or "nccl"
        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = rank
        if impl == "nccl":
            torch.cuda.set_device(local % torch.cuda.device_count())
        dist.init_process_group(impl, rank=rank, world_size=size)

        def allreduce(tensor, name):
            dist.all_reduce(tensor)
    if os.environ.get("RVOD_BENCH_DEVICE") == "cpu":  # a dry run of this script where there is no GPU
        device, synchronize = torch.device("cpu"), lambda: None
    else:
        device, synchronize = torch.device("cuda", local % torch.cuda.device_count()), torch.cuda.synchronize
        torch.cuda.set_device(device)
    results = {}
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        for _ in range(3):
            allreduce(tensor, f"warm.{nbytes}")
        synchronize()
        count = iters if nbytes <= 16 * MiB else max(3, iters // 4) if nbytes <= 64 * MiB else 3
        started = time.perf_counter()
        for i in range(count):
            allreduce(tensor, f"timed.{nbytes}")
        synchronize()
        results[nbytes] = (time.perf_counter() - started) / count
        check = torch.ones(4, device=device)
        allreduce(check, f"check.{nbytes}")
        assert torch.all(check == size).item(), f"{impl}: wrong sum {check.tolist()}"
    if rank == 0:
        print("RESULT " + json.dumps({str(k): v for k, v in results.items()}), flush=True)
    if impl != "rvod":
        import torch.distributed as dist

        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(impl: str, ranks: int, sizes: list[int], iters: int, env: dict[str, str] | None = None) -> dict[int, float]:
    args = [__file__, "--worker", impl, "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)]
    if impl == "rvod":
        proc = subprocess.run([sys.executable, "-m", "rvod.runner", "-np", str(ranks), sys.executable, *args],
                              capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
        outputs = [proc.stdout]
        failed = proc.returncode != 0 and proc.stderr[-3000:]
    else:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
        procs = [subprocess.Popen([sys.executable, *args], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(ranks)]
        finished = [p.communicate(timeout=300) for p in procs]
        outputs = [out for out, _ in finished]
        failed = any(p.returncode for p in procs) and "\n".join(err[-1500:] for _, err in finished)
    if failed:
        raise RuntimeError(f"{impl} job of {ranks} ranks failed:\n{failed}")
    for out in outputs:
        for line in out.splitlines():
            if "RESULT " in line:
                return {int(k): v for k, v in json.loads(line.split("RESULT ", 1)[1]).items()}
    raise RuntimeError(f"{impl}: no RESULT line in:\n{outputs}")


def timeline_phases(path: Path) -> dict[str, float]:
    """Median microseconds of each phase of the timed ops in an rvod timeline (``RVOD_TIMELINE``), and the median
    time from one op's negotiation to the next's ("period"): where a 1-rank op's time goes."""
    events = json.loads(path.read_text())
    timed = {e["pid"] for e in events if e.get("name") == "process_name" and "timed." in e["args"]["name"]}
    phases: dict[str, list[float]] = {}
    starts = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in timed:
            phases.setdefault(e["name"], []).append(e["dur"])
            if e["name"].startswith("NEGOTIATE"):
                starts.append(e["ts"])
    starts.sort()
    medians = {name: statistics.median(durations) for name, durations in phases.items()}
    if len(starts) > 1:
        medians["period"] = statistics.median(b - a for a, b in zip(starts, starts[1:]))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.iters)
        return
    # Rounds alternate the implementations (rvod, gloo, rvod, gloo, ...) so a machine busy with something else
    # slows both alike; each figure is the median over the rounds, each ratio the median of per-round ratios.
    rounds = {"rvod": [], "gloo": []}
    for _ in range(args.rounds):
        for impl in rounds:
            rounds[impl].append(run_job(impl, args.ranks, sizes, args.iters))
    one_rank = run_job("rvod", 1, sizes, args.iters)
    one_rank_async = run_job("rvod", 1, sizes, args.iters, {"RVOD_ENABLE_ASYNC_COMPLETION": "1"})
    try:
        nccl_1_rank = run_job("nccl", 1, sizes, args.iters)
    except RuntimeError as why:  # no NCCL backend in this torch (or a dry run on CPU)
        print(f"torch.distributed NCCL on 1 rank not timed: {str(why).splitlines()[0]}")
        nccl_1_rank = {n: float("nan") for n in sizes}
    # Where a 1-rank 4-byte op's time goes, from rvod's timeline (a run of its own: recording costs time too).
    timeline = Path(args.out or "gpu-bench.json").with_name("gpu-bench-timeline.json")
    run_job("rvod", 1, [4], 200, {"RVOD_TIMELINE": str(timeline)})
    phases = timeline_phases(timeline)
    median = statistics.median
    report = {"ranks": args.ranks, "sizes": sizes, "rounds": rounds, "rvod_1_rank": one_rank,
              "rvod_1_rank_async_completion": one_rank_async, "torch_nccl_1_rank": nccl_1_rank,
              "rvod_1_rank_4_bytes_timeline_us": phases}
    print(f"CUDA float32 allreduce, {args.ranks} ranks sharing one GPU (rank 0's mean per call; median of "
          f"{args.rounds} alternating rounds); busbw = bytes / time * 2 (n - 1) / n")
    print(f"{'bytes':>10} {'rvod us':>10} {'gloo us':>10} {'rvod/gloo time':>15} {'rvod busbw GB/s':>16} "
          f"{'gloo busbw GB/s':>16} {'1 rank: rvod us':>16} {'async us':>9} {'torch nccl us':>14}")
    factor = 2 * (args.ranks - 1) / args.ranks
    for n in sizes:
        rv, gl = median(r[n] for r in rounds["rvod"]), median(r[n] for r in rounds["gloo"])
        ratio = median(a[n] / b[n] for a, b in zip(rounds["rvod"], rounds["gloo"]))
        print(f"{n:>10} {rv * 1e6:>10.1f} {gl * 1e6:>10.1f} {ratio:>15.2f} {n / rv * factor / 1e9:>16.2f} "
              f"{n / gl * factor / 1e9:>16.2f} {one_rank[n] * 1e6:>16.1f} {one_rank_async[n] * 1e6:>9.1f} "
              f"{nccl_1_rank[n] * 1e6:>14.1f}")
    print("1 rank, 4 bytes, rvod's timeline (median us): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
