"""Multi-process tests of behaviour Horovod scripts rely on in the torch, tensorflow and numpy shims, run
through rvodrun.

workers/objects.py checks broadcast_object and allgather_object with objects from 0 bytes to over 1 MiB through
rvod.numpy and rvod.tensorflow (3 ranks; the MXNet run is in test_mxnet_conformance.py); every shim serves the
one implementation in rvod.common.objects. workers/torch_conformance.py (2 ranks) trains SparseAdam on a sparse
embedding against one process on the full batch, checks the gradients broadcast_optimizer_state leaves, and
rvod.torch's object helpers with objects over 64 KiB.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

# Checks each rank passes (tensorflow adds graph mode). rvod.torch's helpers are checked in torch_conformance.py.
FRAMEWORKS = {"numpy": 4, "tensorflow": 6}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_object_helpers_carry_objects_of_any_size(run_rvodrun, framework):
    pytest.importorskip(framework)
    result = run_rvodrun(["-np", "3", sys.executable, str(WORKERS / "objects.py"), framework], timeout=120)
    assert_worker_job(result, {rank: FRAMEWORKS[framework] for rank in range(3)})


@pytest.mark.timeout(150)
def test_torch_sparse_gradients_and_optimizer_state_broadcast(run_rvodrun):
    pytest.importorskip("torch")
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "torch_conformance.py")], timeout=120)
    assert_worker_job(result, {0: 10, 1: 10})
