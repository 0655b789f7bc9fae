"""Multi-process tests of rvod.torch's ops, run through rvodrun with 2 and 3 ranks, and a job of size 1.

workers/torch_collectives.py checks what rvod.torch does beyond the collective cases of every shim
(test_collectives.py runs every op x dtype x variant): the gradient of every differentiable op, the error
cases, compression, sparse allreduce and join; workers/torch_single.py checks the DLPack adapter and size-1
behaviour.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("torch", reason="rvod.torch needs PyTorch (pip install torch) to be tested")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_gradients_errors_and_torch_specifics(run_rvodrun, size):
    result = run_rvodrun(["-np", str(size), sys.executable, str(WORKERS / "torch_collectives.py")], timeout=100)
    assert_worker_job(result, {rank: 59 for rank in range(size)})


@pytest.mark.timeout(60)
def test_size_one_without_rvodrun(job_env):
    env = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_")) or k == "RVOD_TEST_JOB_TAG"}
    result = subprocess.run([sys.executable, str(WORKERS / "torch_single.py")], env=env, capture_output=True,
                            text=True, timeout=50)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-20000:]}"
    assert result.returncode == 0, report
    assert result.stdout.strip().splitlines()[-1] == "rank 0: 7 checks passed, 0 failed", report
