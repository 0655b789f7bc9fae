"""Worker of test_timeline.py: runs collectives while the timeline records, in one of these modes.

ops OUT       every collective kind once (and a process set of ranks 0 and 2 when there are 3 ranks)
dynamic A B   RVOD_TIMELINE=DYNAMIC: ops before start (not recorded), into A, switch to B while an op is
              in flight, stop, ops after (not recorded)
loop DIR      allreduces until killed; writes DIR/pid<rank> and DIR/steps<rank> so the test can kill it
"""

import os
import sys

import numpy as np
import rvod.numpy as hvd

mode = sys.argv[1]
hvd.init()
R, N = hvd.rank(), hvd.size()


def every_op(tag):
    x = np.full((4, 3), R + 1, np.float32)
    assert np.array_equal(hvd.allreduce(x, name=f"{tag}.grad", op=hvd.Sum), np.full((4, 3), N * (N + 1) / 2))
    group = [np.full((5,), R, np.float64), np.full((2, 2), R, np.float64), np.full((3,), R, np.float64)]
    hvd.grouped_allreduce(group, name=f"{tag}.group", op=hvd.Sum)
    assert hvd.allgather(np.full((R + 1, 2), R, np.int32), name=f"{tag}.gathered").shape == (N * (N + 1) // 2, 2)
    assert hvd.broadcast(np.full((6,), R, np.int64), root_rank=0, name=f"{tag}.weights")[0] == 0
    assert hvd.alltoall(np.arange(2 * N, dtype=np.float32), name=f"{tag}.scattered").shape == (2 * N,)
    assert hvd.reducescatter(np.ones((2 * N, 3), np.float32), name=f"{tag}.rs", op=hvd.Sum).shape == (2, 3)


if mode == "ops":
    every_op("step")
    if N == 3:
        pair = hvd.add_process_set([0, 2])
        if R in (0, 2):
            hvd.allreduce(np.ones(7, np.float32), name="pair.grad", op=hvd.Sum, process_set=pair)
        hvd.barrier()
elif mode == "dynamic":
    first, second = sys.argv[2], sys.argv[3]
    every_op("before")
    hvd.start_timeline(first)
    every_op("in_a")
    handle = hvd.allreduce_async(np.ones(1 << 16, np.float32), name="switching.grad", op=hvd.Sum)
    hvd.start_timeline(second, mark_cycles=True)
    hvd.synchronize(handle)
    every_op("in_b")
    hvd.stop_timeline()
    hvd.stop_timeline()  # a second stop does nothing
    every_op("after")
elif mode == "loop":
    out = sys.argv[2]
    with open(os.path.join(out, f"pid{R}"), "w") as f:
        f.write(str(os.getpid()))
    step = 0
    while True:
        hvd.allreduce(np.ones(1000, np.float32), name=f"loop.{step % 7}", op=hvd.Sum)
        step += 1
        if step % 50 == 0:
            with open(os.path.join(out, f"steps{R}"), "w") as f:
                f.write(str(step))
print(f"rank {R}: done", flush=True)
hvd.shutdown()
