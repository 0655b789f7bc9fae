"""Multi-process tests of rvod.mxnet's ops, run through rvodrun with 2 ranks, and a job of size 1.

workers/mxnet_collectives.py checks what rvod.mxnet does beyond the collective cases of every shim
(test_mxnet_collective_cases.py runs every op x dtype x variant): Horovod's positional argument orders,
MXNet's asynchronous engine, mx.np arrays, the mismatch and bad-input errors, the object helpers, barrier,
join, re-init and process sets; workers/mxnet_single.py checks the DLPack round trip and size-1 behaviour.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("mxnet", reason="rvod.mxnet needs MXNet 1.9 (make its environment with scripts/setup-mxnet-env.sh)")


@pytest.mark.timeout(150)
def test_mxnet_specifics_and_errors(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "mxnet_collectives.py")], timeout=120)
    assert_worker_job(result, {0: 13, 1: 13})


@pytest.mark.timeout(60)
def test_size_one_without_rvodrun(job_env):
    env = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_")) or k == "RVOD_TEST_JOB_TAG"}
    result = subprocess.run([sys.executable, str(WORKERS / "mxnet_single.py")], env=env, capture_output=True,
                            text=True, timeout=50)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-20000:]}"
    assert result.returncode == 0, report
    assert result.stdout.strip().splitlines()[-1] == "rank 0: 5 checks passed, 0 failed", report
