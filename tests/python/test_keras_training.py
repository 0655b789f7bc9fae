"""Multi-process tests of rvod.keras (Keras 3), run through rvodrun with 2 ranks:
workers/keras_training.py trains with model.fit, DistributedOptimizer and the callbacks and, in the same
process, a reference on the full batch; it checks that the weights are identical on every rank and equal
to the reference after every epoch, the averaged metrics, the warm-up and schedule values, gradient
aggregation, run_eagerly, load_model, the value helpers and the argument errors (TensorFlow backend);
workers/keras_torch_backend.py checks the same equivalence under Keras' torch backend."""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("tensorflow", reason="rvod.keras needs TensorFlow (pip install .[tensorflow]) to be tested")
pytest.importorskip("keras", reason="rvod.keras needs Keras 3 (pip install .[tensorflow]) to be tested")


@pytest.mark.timeout(240)
def test_fit_matches_one_process_and_callbacks_work(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "keras_training.py")], timeout=220)
    assert_worker_job(result, {0: 10, 1: 10})


@pytest.mark.timeout(200)
def test_fit_under_the_torch_backend_matches_one_process(run_rvodrun):
    pytest.importorskip("torch", reason="Keras' torch backend needs PyTorch")
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "keras_torch_backend.py")], timeout=180)
    assert_worker_job(result, {0: 1, 1: 1})
