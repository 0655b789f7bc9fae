"""The TensorFlow and Keras examples run under rvodrun with 2 ranks and train the digits CNN past 90% test
accuracy, rank 0 alone printing and writing its checkpoint."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow", reason="the TensorFlow examples need TensorFlow (pip install .[tensorflow])")
pytest.importorskip("keras", reason="the TensorFlow examples need Keras 3 (pip install .[tensorflow])")
pytest.importorskip("sklearn", reason="the digits examples need scikit-learn")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FINAL = re.compile(r"^\[0\]<stdout>:trained on 2 ranks in [\d.]+ s; test accuracy (\d\.\d+); checkpoint in (\S+)$",
                   re.MULTILINE)


def run_example(run_rvodrun, tmp_path, script, epoch_line):
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / script), "--checkpoint-dir", str(tmp_path)],
                         timeout=170)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{result.stderr[-5000:]}"
    assert result.returncode == 0, report
    final = FINAL.search(result.stdout)
    assert final and float(final.group(1)) > 0.9, report
    assert final.group(2) == str(tmp_path), report
    assert len(re.findall(epoch_line, result.stdout, re.MULTILINE)) == 12, report
    assert "[1]<stdout>:" not in result.stdout, "only rank 0 prints"
    return result


@pytest.mark.timeout(200)
def test_keras_example_fits_with_callbacks_to_high_accuracy(run_rvodrun, tmp_path):
    result = run_example(run_rvodrun, tmp_path, "keras_digits.py", r"^\[0\]<stdout>:Epoch \d+/12$")
    assert "[0]<stdout>:Epoch 3: finished gradual learning rate warmup to 0.04." in result.stdout
    assert (tmp_path / "checkpoint.keras").is_file()


@pytest.mark.timeout(200)
def test_tensorflow2_example_trains_with_gradient_tape_to_high_accuracy(run_rvodrun, tmp_path):
    run_example(run_rvodrun, tmp_path, "tensorflow2_digits.py",
                r"^\[0\]<stdout>:epoch \d+/12: loss [\d.]+ \(mean over ranks\)$")
    assert (tmp_path / "digits.weights.h5").is_file()


ADASUM_FINAL = re.compile(r"^\[0\]<stdout>:Adasum on 2 ranks: test loss (\S+) after 100 steps; below 0.001 from step "
                          r"(\d+); fitted \((\S+), (\S+), (\S+)\); parameters identical on every rank: True$",
                          re.MULTILINE)


@pytest.mark.timeout(120)
def test_adasum_small_model_example_converges_with_identical_parameters(run_rvodrun):
    """The small-model experiment with a TensorFlow 1 optimizer: a graph with DistributedOptimizer(op=Adasum)
    fits the quadratic on 2 ranks."""
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "tensorflow_adasum_small_model.py"), "--use-adasum",
                          "--learning-rate", "0.5", "--steps", "100"], timeout=110)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{result.stderr[-5000:]}"
    assert result.returncode == 0, report
    final = ADASUM_FINAL.search(result.stdout)
    assert final, report
    assert float(final.group(1)) < 1e-6 and int(final.group(2)) < 100, report
    assert all(abs(float(v) - want) < 0.01 for v, want in zip(final.groups()[2:], (3.0, -2.0, 1.0))), report
