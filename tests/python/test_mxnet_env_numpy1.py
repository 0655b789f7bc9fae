"""rvod.numpy under NumPy 1.x: the MXNet environment pins numpy<1.24, so this file runs there (as every
test_mxnet_*.py does) and checks rvod.numpy's collective cases (collective_cases.py, over shared memory)
and its other checks (workers/collectives.py) with NumPy 1.23 on 2 ranks. It covers what differs between
NumPy generations: reading arrays from NumPy's struct, and bool results, which NumPy before 1.25 cannot
import by DLPack.
"""

from __future__ import annotations

import sys

import pytest
from collective_suite import ITEM_TIMEOUT, assert_case_passed, collective_jobs, parameters  # noqa: F401
from jobs import WORKERS, failures, verdicts
from test_numpy_collectives import CHECKS

np = pytest.importorskip("numpy")
if int(np.__version__.split(".")[0]) >= 2:
    pytest.skip("NumPy 2 is covered by test_collectives.py and test_numpy_collectives.py; this file is for "
                "NumPy 1.x (the MXNet environment)", allow_module_level=True)


@pytest.mark.timeout(150)
def test_numpy_specifics_under_numpy_1(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "collectives.py")], timeout=120)
    found = verdicts(result.stdout)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    assert set(found) == {0, 1}, report
    assert all(failed == 0 for _, failed in found.values()), report
    assert found == {0: (CHECKS, 0), 1: (CHECKS, 0)}, report
    assert "array struct is not laid out as expected" not in result.stderr, report


@pytest.mark.timeout(ITEM_TIMEOUT)
@pytest.mark.parametrize("group, case", parameters(["numpy"], transports=["shm"], rank_counts=[2]))
def test_collective_under_numpy_1(collective_jobs, group, case):  # noqa: F811
    assert_case_passed(collective_jobs(group), group, case)
