"""rvod.keras DistributedOptimizer(sharded=True) (issue 33): workers/keras_sharded.py on 2 ranks trains with
model.fit against the plain DistributedOptimizer, measures the state per rank, and checks the refusals."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("keras", reason="rvod.keras needs Keras 3 (pip install keras tensorflow) to be tested")
pytest.importorskip("tensorflow", reason="rvod.keras' sharded optimizer needs TensorFlow to be tested")


@pytest.mark.timeout(200)
def test_keras_sharded_adam_equals_plain_with_half_the_state(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "keras_sharded.py")], timeout=170)
    assert_worker_job(result, {0: 4, 1: 4})
