"""Multi-process tests of rvod.tensorflow, run through rvodrun with 2 ranks (TensorFlow imports slowly, so
one job checks everything): workers/tensorflow_ops.py checks every op eagerly and inside tf.function
against exact values, the gradients Horovod defines, DistributedGradientTape, the broadcast helpers and
objects, and the error cases."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("tensorflow", reason="rvod.tensorflow needs TensorFlow (pip install .[tensorflow]) to be tested")


@pytest.mark.timeout(240)
def test_every_op_eager_and_traced_gradients_tape_and_errors(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "tensorflow_ops.py")], timeout=220)
    assert_worker_job(result, {0: 44, 1: 44})
