"""A bare small-allreduce loop to run under a profiler (strace -c, perf): no phases, no bookkeeping.

    rvodrun -np 2 python benches/allreduce_loop.py --calls 2000             # rvod, 4 bytes, fixed name
    rvodrun -np 2 python benches/allreduce_loop.py --tensors 1024 --bytes 4096 --calls 20 --warmup 2
    python benches/allreduce_loop.py --impl gloo --calls 2000               # with RANK/WORLD_SIZE/MASTER_* set

Runs --warmup untimed calls, then --calls timed ones, and prints this rank's p50/p90 per call. Comparing two
runs with different --calls isolates the per-call cost from start-up (e.g. syscall counts per op).
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("rvod", "gloo"), default="rvod")
    p.add_argument("--bytes", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--tensors", type=int, default=1,
                   help="tensors per call: >1 submits them all asynchronously, then waits for all (fusion)")
    args = p.parse_args()
    count = max(1, args.bytes // 4)

    if args.impl == "rvod":
        import rvod.numpy as hvd

        hvd.init()
        rank = hvd.rank()
        x = np.zeros(count, dtype=np.float32)
        xs = [np.zeros(count, dtype=np.float32) for _ in range(args.tensors)]
        names = [f"loop.{i}" for i in range(args.tensors)]

        def call():
            if args.tensors == 1:
                hvd.allreduce(x, name="loop", op=hvd.Sum)
                return
            handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(xs, names)]
            for h in handles:
                hvd.synchronize(h)

        barrier, finish = hvd.barrier, hvd.shutdown
    else:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        x = torch.zeros(count, dtype=torch.float32)
        xs = [torch.zeros(count, dtype=torch.float32) for _ in range(args.tensors)]

        def call():
            if args.tensors == 1:
                dist.all_reduce(x)
                return
            for w in [dist.all_reduce(t, async_op=True) for t in xs]:
                w.wait()

        barrier, finish = dist.barrier, dist.destroy_process_group

    for _ in range(args.warmup):
        call()
    barrier()
    samples = []
    for _ in range(args.calls):
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    barrier()
    finish()
    if samples:
        samples.sort()
        print(f"rank {rank}: {args.impl} {args.tensors} x {args.bytes} B, {args.calls} calls: p50 {samples[len(samples) // 2] / 1e3:.1f} us, "
              f"p90 {samples[int(len(samples) * 0.9)] / 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
