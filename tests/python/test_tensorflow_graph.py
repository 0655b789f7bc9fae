"""rvod.tensorflow in TensorFlow 1 graph mode (tf.compat.v1 graphs run by a Session), 2 ranks through rvodrun,
one job (TensorFlow imports slowly): workers/tensorflow_graph.py checks every collective against exact
values and its gradient, broadcast_global_variables, BroadcastGlobalVariablesHook in a
MonitoredTrainingSession, DistributedOptimizer wrapping tf.compat.v1.train optimizers (identical on every
rank and equal to one process on the whole batch), the object helpers and a mismatch. A failed check is
reported by name in the job's stderr. About 35 s."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("tensorflow", reason="rvod.tensorflow needs TensorFlow (pip install .[tensorflow]) to be tested")


@pytest.mark.timeout(240)
def test_every_op_and_tf1_training_in_a_v1_graph_under_a_session(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "tensorflow_graph.py")], timeout=220)
    assert_worker_job(result, {0: 25, 1: 25})
