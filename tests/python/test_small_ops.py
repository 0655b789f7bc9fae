"""Small synchronous ops through ``_rvod.submit`` with ``wait`` (the fast lane, src/engine/fast_lane.rs, once an op is cached):
what a user checks of each result, ranks taking different paths for one op, a mismatch in steady state, the
GIL released while a rank waits for a late peer (workers/small_ops_numpy.py, small_ops_torch.py). 2 and 3
ranks; about 15 s."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_small_numpy_ops_in_steady_state(run_rvodrun, size):
    result = run_rvodrun(["-np", str(size), sys.executable, str(WORKERS / "small_ops_numpy.py")], timeout=100)
    assert_worker_job(result, {rank: 12 for rank in range(size)})


@pytest.mark.timeout(120)
def test_small_torch_ops_in_steady_state(run_rvodrun):
    pytest.importorskip("torch")
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "small_ops_torch.py")], timeout=100)
    assert_worker_job(result, {rank: 8 for rank in range(2)})
