"""Every collective of rvod.mxnet, one test item per case of collective_cases.py (the cases the NumPy,
PyTorch and TensorFlow shims run in test_collectives.py, less what MXNet 1.9 cannot express), in one
rvodrun job of 2 ranks. Runs in the MXNet environment: scripts/run-mxnet-tests.sh.
"""

from __future__ import annotations

import pytest
from collective_suite import ITEM_TIMEOUT, assert_case_passed, collective_jobs, parameters  # noqa: F401

pytest.importorskip("mxnet", reason="rvod.mxnet needs MXNet 1.9 (make its environment with scripts/setup-mxnet-env.sh)")


@pytest.mark.timeout(ITEM_TIMEOUT)
@pytest.mark.parametrize("group, case", parameters(["mxnet"]))
def test_collective(collective_jobs, group, case):  # noqa: F811
    assert_case_passed(collective_jobs(group), group, case)
