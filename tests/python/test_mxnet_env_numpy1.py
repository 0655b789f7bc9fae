"""rvod.numpy under NumPy 1.x: the MXNet environment pins numpy<1.24, so this file runs there (as every
test_mxnet_*.py does) and checks rvod.numpy's whole collective matrix with NumPy 1.23 on 2 ranks. It covers
what differs between NumPy generations: reading arrays from NumPy's struct, and bool results, which NumPy
before 1.25 cannot import by DLPack.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, failures, verdicts

np = pytest.importorskip("numpy")
if int(np.__version__.split(".")[0]) >= 2:
    pytest.skip("NumPy 2 is covered by test_numpy_collectives.py; this file is for NumPy 1.x (the MXNet "
                "environment)", allow_module_level=True)


@pytest.mark.timeout(150)
def test_every_numpy_collective_under_numpy_1(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "collectives.py")], timeout=120)
    found = verdicts(result.stdout)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    assert set(found) == {0, 1}, report
    assert all(failed == 0 for _, failed in found.values()), report
    assert all(passed > 1000 for passed, _ in found.values()), report
    assert "array struct is not laid out as expected" not in result.stderr, report
