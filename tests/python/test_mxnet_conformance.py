"""Multi-process tests of rvod.mxnet behaviour horovod.mxnet scripts rely on, run through rvodrun.

workers/objects.py (3 ranks) checks broadcast_object and allgather_object with objects from 0 bytes to over
1 MiB (the object helpers of every shim are rvod.common.objects); workers/mxnet_alltoall_errors.py (2 ranks)
runs Horovod's alltoall error tests and checks that every bad split is refused as an MXNetError;
workers/refusals.py (2 ranks) checks that every op refused at submission is an MXNetError, a ValueError and a
RuntimeError and takes no default name, and Horovod's join sequence (see test_refusals.py).
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("mxnet", reason="rvod.mxnet needs MXNet 1.9 (make its environment with scripts/setup-mxnet-env.sh)")


@pytest.mark.timeout(150)
def test_object_helpers_carry_objects_of_any_size(run_rvodrun):
    result = run_rvodrun(["-np", "3", sys.executable, str(WORKERS / "objects.py"), "mxnet"], timeout=120)
    assert_worker_job(result, {0: 4, 1: 4, 2: 4})


@pytest.mark.timeout(100)
def test_alltoall_argument_errors_are_mxnet_errors(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "mxnet_alltoall_errors.py")], timeout=80)
    assert_worker_job(result, {0: 5, 1: 5})


@pytest.mark.timeout(200)
def test_refused_ops_raise_mxnet_errors_and_take_no_name(run_rvodrun, job_env):
    job_env["RVOD_STALL_CHECK_TIME_SECONDS"] = "5"  # a mix-up of names shows in the report
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "refusals.py"), "mxnet"], timeout=180)
    assert_worker_job(result, {0: 6, 1: 6})
