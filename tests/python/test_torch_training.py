"""Multi-process tests of rvod.torch training, run through rvodrun with 2 and 3 ranks.

workers/torch_training.py trains with DistributedOptimizer on shards and, in the same process, a reference
on the full batch, and checks they agree after every step and that every rank holds identical parameters;
it also covers the optimizer's options and errors, the broadcast helpers for eleven optimizers,
SyncBatchNorm against nn.BatchNorm on the concatenated batch, and a process set without rank 0.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

torch = pytest.importorskip("torch", reason="rvod.torch needs PyTorch (pip install torch) to be tested")
# The worker checks GradScaler only where PyTorch has one for CPU tensors (from 2.3).
SCALER_CHECKS = 1 if hasattr(torch.amp, "GradScaler") else 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_distributed_training_matches_one_process(run_rvodrun, size):
    result = run_rvodrun(["-np", str(size), sys.executable, str(WORKERS / "torch_training.py")], timeout=100)
    # Rank 0 is outside the process set of the last section, which has two checks.
    assert_worker_job(result, {rank: (57 if rank == 0 else 59) - 1 + SCALER_CHECKS for rank in range(size)})
