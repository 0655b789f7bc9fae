"""rvod.keras DistributedOptimizer(sharded=True) (issue 33): workers/keras_sharded.py on 2 ranks trains with
model.fit against the plain DistributedOptimizer (backward_passes_per_step 1 and 2), measures the state per
rank, round-trips and consolidates checkpoints and checks the refusals; workers/keras_sharded_reshard.py on 3
ranks loads the 2-rank job's checkpoint files, resharded."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("keras", reason="rvod.keras needs Keras 3 (pip install keras tensorflow) to be tested")
pytest.importorskip("tensorflow", reason="rvod.keras' sharded optimizer needs TensorFlow to be tested")


@pytest.mark.timeout(300)
def test_keras_sharded_equals_plain_and_its_checkpoints_reshard_from_2_to_3_ranks(run_rvodrun, tmp_path):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "keras_sharded.py"), str(tmp_path)], timeout=170)
    assert_worker_job(result, {0: 8, 1: 8})
    result = run_rvodrun(["-np", "3", sys.executable, str(WORKERS / "keras_sharded_reshard.py"), str(tmp_path)],
                         timeout=120)
    assert_worker_job(result, {0: 3, 1: 3, 2: 3})
