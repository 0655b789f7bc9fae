"""rvod.torch under torch.compile, run through rvodrun with 2 ranks: workers/torch_compile.py checks every
synchronous op inside a compiled function against eager mode (values and gradients, float32 and int32), that
torch._dynamo's explain finds no graph break around allreduce, allgather and broadcast, the error of an
allgather traced for equal first dimensions, and a compiled MLP trained with DistributedOptimizer (plain and
sharded) on the digits data to the eager model's parameters."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

torch = pytest.importorskip("torch", reason="rvod.torch needs PyTorch (pip install torch) to be tested")
if not hasattr(torch.library, "custom_op"):
    pytest.skip(f"torch.compile traces rvod's ops from PyTorch 2.4 (torch.library.custom_op), this is "
                f"{torch.__version__}; before, they break the graph and run eagerly", allow_module_level=True)
pytest.importorskip("sklearn", reason="the training check uses scikit-learn's digits data")


@pytest.mark.timeout(150)
def test_ops_gradients_and_training_under_torch_compile(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "torch_compile.py")], timeout=130)
    assert_worker_job(result, {0: 10, 1: 10})
