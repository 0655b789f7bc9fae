"""Prints which cores this rank's engine thread and main thread may run on (RVOD_THREAD_AFFINITY checks)."""

import os
import threading

import numpy as np

import rvod.numpy as hvd

hvd.init()
assert float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0]) == hvd.size()


def thread_name(tid):
    """The thread's name, or None when it ended since the folder was listed (short-lived helper threads)."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as comm:
            return comm.read().strip()
    except FileNotFoundError:
        return None


engine = [int(tid) for tid in os.listdir("/proc/self/task") if thread_name(tid) == "rvod-set0"]
assert len(engine) == 1, engine
report = (f"rank {hvd.rank()}: engine {sorted(os.sched_getaffinity(engine[0]))} "
          f"main {sorted(os.sched_getaffinity(threading.get_native_id()))}")
# No rank shuts down (which ends every rank's engine thread) before every rank has looked at its own.
hvd.barrier()
print(report, flush=True)
hvd.shutdown()
