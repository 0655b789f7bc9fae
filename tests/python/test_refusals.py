"""Refused ops and the default names of the ops after them, in every shim, through rvodrun with 2 ranks (the
worker side is workers/refusals.py).

Every op refused at submission raises ``RvodInvalidArgumentError``, which Horovod's callers catch as
``RuntimeError`` and rvod's as ``ValueError``. A refused op takes no default name, so the unnamed ops after
refusals on one rank still match on every rank, and after ``join()`` they match whatever failed before it
(Horovod's join sequence: rank 0 joins, rank 1's allgather fails, rank 1 joins, then both call
``allgather_object``). A mix-up shows as a mismatch or a hang, which the timeout turns into a failure.
The MXNet run is in test_mxnet_conformance.py.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

# Checks each rank passes (rvod.keras has no join and no object helpers).
FRAMEWORKS = {"numpy": 6, "torch": 6, "tensorflow": 6, "keras": 3}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_refused_ops_raise_runtime_errors_and_take_no_name(run_rvodrun, job_env, framework):
    for module in ("tensorflow", "keras") if framework == "keras" else (framework,):
        pytest.importorskip(module)
    job_env["RVOD_STALL_CHECK_TIME_SECONDS"] = "5"  # a mix-up of names shows in the report
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "refusals.py"), framework], timeout=180)
    assert_worker_job(result, {rank: FRAMEWORKS[framework] for rank in range(2)})
