"""A burst of reduce-scatters: rvod against Open MPI, side by side in the same run.

    python benches/reducescatter_burst.py [--np 2] [--rounds 3] [--bursts 30]

Each job starts `count` reduce-scatters of `count` float32 tensors at once and waits for them all, `--bursts`
times after warming up: rvod with `reducescatter_async` per tensor then `synchronize` (the engine fuses
reduce-scatters of tensors up to 64 KiB into one), MPI with `Ireduce_scatter_block` per tensor then
`Waitall` (mpi4py on NumPy arrays, under `mpirun`). The jobs alternate within a round, so a machine busy
with something else slows both alike. Prints per shape the median burst time over the rounds (each round's
figure the median of its bursts) and MPI's time over rvod's (> 1: rvod is faster). Needs mpi4py and Open
MPI's mpirun for the MPI side (scripts/setup-system.sh installs them).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

# (tensors, float32 elements each, rounded down to a multiple of the ranks): 4 KiB and 64 KiB tensors, which
# rvod fuses, and 4 MiB ones, which it runs one by one.
SHAPES = [(256, 1 << 10), (64, 16 << 10), (12, 1 << 20)]


def worker(impl, bursts, warmup):
    import numpy as np

    if impl == "rvod":
        import rvod.numpy as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def burst(tensors, tag):
            handles = [hvd.reducescatter_async(t, name=f"{tag}.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
            for handle in handles:
                hvd.synchronize(handle)
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def burst(tensors, tag):
            outs = [np.empty(t.size // size, np.float32) for t in tensors]
            MPI.Request.Waitall([comm.Ireduce_scatter_block(t, o, op=MPI.SUM) for t, o in zip(tensors, outs)])

    results = {}
    for count, elements in SHAPES:
        elements -= elements % size
        tensors = [np.ones(elements, np.float32) for _ in range(count)]
        times = []
        for i in range(warmup + bursts):
            started = time.perf_counter()
            burst(tensors, f"rs{count}")
            if i >= warmup:
                times.append(time.perf_counter() - started)
        results[f"{count}x{elements * 4}"] = statistics.median(times)
    if rank == 0:
        print(json.dumps({"impl": impl, "results": results}), flush=True)


def run_job(impl, np_, bursts, warmup):
    args = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--bursts", str(bursts), "--warmup",
            str(warmup)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if impl == "rvod":
        cmd = [sys.executable, "-m", "rvod.runner", "-np", str(np_)] + args
    else:
        cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", "--oversubscribe"]
        cmd += ["--allow-run-as-root"] if os.geteuid() == 0 else []
        cmd += args
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [line.split(">:", 1)[-1] for line in result.stdout.splitlines() if '"impl"' in line]
    if result.returncode or not lines:
        raise SystemExit(f"{impl} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])["results"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", choices=("rvod", "mpi"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.bursts, args.warmup)
    impls = ["rvod"]
    try:
        import mpi4py  # noqa: F401

        if shutil.which("mpirun"):
            impls.append("mpi")
    except ImportError:
        pass
    if len(impls) == 1:
        print("note: mpi4py or mpirun is missing, so MPI is not measured", file=sys.stderr)
    rounds = {impl: [] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            rounds[impl].append(run_job(impl, args.np, args.bursts, args.warmup))
    print(f"{args.np} ranks, {args.rounds} rounds of {args.bursts} bursts; ms per burst, median over rounds "
          "[min-max]; ratio: MPI's time over rvod's, per round, median (> 1: rvod is faster)")
    for key in rounds["rvod"][0]:
        count, size_bytes = (int(x) for x in key.split("x"))
        row = [f"{count:>4} x {size_bytes / 1024:>6.0f} KiB"]
        for impl in impls:
            values = [r[key] * 1e3 for r in rounds[impl]]
            row.append(f"{impl} {statistics.median(values):7.2f} [{min(values):.2f}-{max(values):.2f}]")
        if "mpi" in rounds:
            ratio = statistics.median(m[key] / r[key] for r, m in zip(rounds["rvod"], rounds["mpi"]))
            row.append(f"mpi/rvod {ratio:.2f}x")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
