"""Large out-of-place results read their input where it is (src/ring/allreduce.rs `allreduce_into`, the
reduce-scatter ring in src/ring/reducescatter.rs): the result is right element by element, for sizes that
span many pipeline pieces and split unevenly, and the input is never changed. 2 ranks (the two-rank
pipeline over shared memory) and 3 (the ring, with scratch blocks); about 10 s."""

from __future__ import annotations

import sys

import pytest
from jobs import assert_worker_job

WORKER = r"""
import numpy as np
import rvod.numpy as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
checks = 0
count = (3 << 20) + 7  # 12 MiB of float32 and an odd element count: uneven halves, a short last piece

def contribution(r, dtype):
    return ((np.arange(count) * 7 + r * 3) % 11).astype(dtype)

ranks = [contribution(r, np.float64) for r in range(size)]
for dtype in (np.float32, np.int16):
    x = contribution(rank, dtype)
    before = x.copy()
    for op, want in ((hvd.Sum, sum(ranks)), (hvd.Min, np.minimum.reduce(ranks)), (hvd.Max, np.maximum.reduce(ranks))):
        y = hvd.allreduce(x, op=op, name=f"oop.{dtype.__name__}.{op}")
        assert y.dtype == dtype and y.shape == x.shape, (y.dtype, y.shape)
        assert np.array_equal(y, want.astype(dtype)), f"{dtype.__name__} op {op}: first wrong at {np.argmax(y != want.astype(dtype))}"
        assert np.array_equal(x, before), f"{dtype.__name__} op {op}: the input changed"
        checks += 1
x = contribution(rank, np.float32)
y = hvd.allreduce(x, op=hvd.Average, name="oop.average")
assert np.allclose(y, sum(ranks) / size), "average"
y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, name="oop.prescaled")
assert np.array_equal(y, (2 * sum(ranks)).astype(np.float32)), "prescaled sum"
assert np.array_equal(x, contribution(rank, np.float32)), "a prescaled allreduce changed its input"
checks += 2

rows = x.reshape(-1, 1)
for op, factor in ((hvd.Sum, 1.0), (hvd.Sum, 3.0), (hvd.Average, 1.0)):
    got = hvd.reducescatter(rows, op=op, prescale_factor=factor, name=f"rs.{op}.{factor}")
    full = sum(ranks) * factor / (size if op == hvd.Average else 1)
    bounds = np.cumsum([0] + [count // size + (r < count % size) for r in range(size)])
    want = full[bounds[rank]:bounds[rank + 1]].astype(np.float32).reshape(-1, 1)
    assert got.shape == want.shape and np.allclose(got, want, rtol=1e-6), f"reducescatter op {op} x{factor}"
    assert np.array_equal(x, contribution(rank, np.float32)), f"reducescatter op {op} changed its input"
    checks += 1
print(f"rank {rank}: {checks} checks passed, 0 failed", flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_large_out_of_place_results_are_right_and_leave_the_input(run_rvodrun, size):
    result = run_rvodrun(["-np", str(size), sys.executable, "-c", WORKER], timeout=100)
    assert_worker_job(result, {rank: 11 for rank in range(size)})
