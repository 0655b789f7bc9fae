"""Adasum allreduce against Sum allreduce of the same buffer, in the same run (issue 18's target: Adasum
at most 2.5x the time of Sum).

    rvodrun -np 2 python benches/adasum.py                    # 64 MiB float32, 10 timed calls each
    rvodrun -np 4 python benches/adasum.py --mib 16 --calls 20

Each op gets --warmup untimed calls, then --calls timed ones, alternating Sum and Adasum call by call so
that both see the same machine load; rank 0 prints the median time per call of each with its range, the
ratio of the medians, and the median and range of the ratios of each Adasum call to the Sum call before it
(on a shared machine the pairs see the most similar load).
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    import rvod.numpy as hvd

    hvd.init()
    count = int(args.mib * (1 << 20)) // 4
    x = np.random.default_rng(hvd.rank()).standard_normal(count).astype(np.float32)
    ops = {"Sum": hvd.Sum, "Adasum": hvd.Adasum}
    times = {name: [] for name in ops}
    for call in range(args.warmup + args.calls):
        for name, op in ops.items():
            buf = x.copy()
            hvd.barrier()
            start = time.perf_counter()
            hvd.allreduce_(buf, op=op, name=f"bench.{name}")
            elapsed = time.perf_counter() - start
            if call >= args.warmup:
                times[name].append(elapsed)
    if hvd.rank() == 0:
        median = {name: float(np.median(t)) for name, t in times.items()}
        for name, m in median.items():
            print(f"{name:>6}: {m * 1e3:8.1f} ms per call [{min(times[name]) * 1e3:.1f}-{max(times[name]) * 1e3:.1f}] "
                  f"({args.mib:g} MiB float32, {hvd.size()} ranks, {args.calls} calls)")
        pairs = np.array(times["Adasum"]) / np.array(times["Sum"])
        print(f"Adasum / Sum: {median['Adasum'] / median['Sum']:.2f}x (per pair of calls: median "
              f"{np.median(pairs):.2f}x [{pairs.min():.2f}-{pairs.max():.2f}])")
    hvd.shutdown()


if __name__ == "__main__":
    main()
