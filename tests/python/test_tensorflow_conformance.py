"""TensorFlow/Keras pieces Horovod scripts rely on, 2 ranks through rvodrun, one job (TensorFlow imports
slowly): workers/tensorflow_conformance.py checks hvd.SyncBatchNormalization against BatchNormalization on
the concatenated batch (forward, backward, moving statistics, inference, model.fit), PartialDistributedGradientTape
with Keras 3 variables, the Keras 2 spellings rvod's DistributedOptimizer accepts (a script in the style of
Horovod's Keras synthetic benchmark with the README's changes), and a tf.compat.v1 graph built in an eager
program. A failed check is reported by name in the job's stderr. About 30-40 s."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("tensorflow", reason="rvod.tensorflow needs TensorFlow (pip install .[tensorflow]) to be tested")


@pytest.mark.timeout(240)
def test_sync_batch_norm_partial_tape_keras2_spellings_and_v1_graph_in_eager_program(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "tensorflow_conformance.py")], timeout=220)
    assert_worker_job(result, {0: 12, 1: 12})
