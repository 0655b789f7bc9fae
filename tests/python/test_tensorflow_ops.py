"""Multi-process tests of rvod.tensorflow, run through rvodrun with 2 ranks (TensorFlow imports slowly, so
one job checks everything): workers/tensorflow_ops.py checks what the collective cases (test_collectives.py,
every op x dtype eagerly) leave out: every op and dtype inside tf.function, the one-off arguments eagerly and
traced, the gradients Horovod defines, DistributedGradientTape, the broadcast helpers and objects, and the
error cases."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("tensorflow", reason="rvod.tensorflow needs TensorFlow (pip install .[tensorflow]) to be tested")


@pytest.mark.timeout(240)
def test_traced_ops_gradients_tape_and_errors(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "tensorflow_ops.py")], timeout=220)
    assert_worker_job(result, {0: 41, 1: 41})
