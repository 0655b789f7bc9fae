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

import json
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


@pytest.mark.timeout(120)
def test_a_tensor_refused_as_it_is_crosses_the_boundary_once_before_its_copy(run_rvodrun, job_env):
    """A tensor the native path refuses as it is (a big-endian array) is exported (converted) and submitted
    next: one refused native call, then the copy's, not a second try of the same refusal in between."""
    pytest.importorskip("torch")
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "refusal_crossings.py")], timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "CROSSINGS " in line)
    seen = json.loads(line.split("CROSSINGS ", 1)[1])
    for label in ("numpy allreduce", "numpy broadcast", "numpy allgather", "numpy allreduce_async"):
        assert seen[label]["calls"] == ["refused", "int"], (label, seen[label])
    assert seen["numpy allreduce"]["values"] == [0.0, 2.0, 4.0, 6.0]
    assert seen["numpy broadcast"]["values"] == [0.0, 1.0, 2.0, 3.0]
    assert seen["numpy allgather"]["values"] == [0.0, 1.0, 2.0, 3.0] * 2
    assert seen["numpy allreduce_async"]["values"] == [0.0, 2.0, 4.0, 6.0]
    assert seen["torch allreduce"]["values"] == [0.0, 4.0]
