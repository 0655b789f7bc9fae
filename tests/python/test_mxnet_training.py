"""Multi-process tests of rvod.mxnet training, run through rvodrun with 2 ranks.

workers/mxnet_training.py trains with DistributedTrainer (Gluon) and DistributedOptimizer (Module API) on
shards and, in the same process, a reference on the full batch, and checks after every step that every
rank holds identical parameters equal to the reference's; it also covers broadcast_parameters (deferred
initialization included), the trainer's and the optimizer wrapper's options, and their argument errors.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("mxnet", reason="rvod.mxnet needs MXNet 1.9 (make its environment with scripts/setup-mxnet-env.sh)")


@pytest.mark.timeout(150)
def test_distributed_training_matches_one_process(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "mxnet_training.py")], timeout=120)
    assert_worker_job(result, {0: 13, 1: 13})
