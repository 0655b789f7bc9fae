"""Ops submitted from several threads of a rank at once (rvod/common/ops.py): synchronous ops (which may run
on their caller's thread) interleaved with asynchronous ones from other threads, each thread with its own
tensor names, all ranks agreeing on the results. 2 ranks, 3 threads each; about 5 s."""

from __future__ import annotations

import sys

import pytest
from jobs import assert_worker_job

WORKER = r"""
import threading
import numpy as np
import rvod.numpy as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
errors = []

def synchronous(thread):
    for i in range(300):
        x = np.full(3, float(rank + i + thread), np.float32)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"sync.{thread}.{i}")
        want = sum(r + i + thread for r in range(size))
        if not np.array_equal(y, np.full(3, want, np.float32)):
            errors.append(f"thread {thread} op {i}: {y} != {want}")
        if not np.array_equal(x, np.full(3, float(rank + i + thread), np.float32)):
            errors.append(f"thread {thread} op {i}: the input changed")

def asynchronous(thread):
    for i in range(30):
        xs = [np.full(2, float(rank * j), np.float64) for j in range(10)]
        handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"async.{thread}.{i}.{j}") for j, x in enumerate(xs)]
        for j, h in enumerate(handles):
            hvd.synchronize(h)
            if not np.array_equal(xs[j], np.full(2, float(j * sum(range(size))))):
                errors.append(f"thread {thread} burst {i} tensor {j}: {xs[j]}")

threads = [threading.Thread(target=synchronous, args=(0,)), threading.Thread(target=synchronous, args=(1,)),
           threading.Thread(target=asynchronous, args=(2,))]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
alive = [t for t in threads if t.is_alive()]
assert not alive, f"{len(alive)} threads still running"
assert not errors, errors[:5]
print(f"rank {rank}: 1 checks passed, 0 failed", flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(120)
def test_synchronous_and_asynchronous_ops_from_several_threads(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, "-c", WORKER], timeout=100)
    assert_worker_job(result, {0: 1, 1: 1})
