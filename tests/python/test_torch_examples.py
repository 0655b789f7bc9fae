"""The PyTorch examples run under rvodrun with 2 ranks: the digits CNN reaches its accuracy, and the
synthetic benchmark prints Horovod's report (here with a tiny model and few batches)."""

from __future__ import annotations

import re
import sys

import pytest
from jobs import EXAMPLES, assert_digits_example_succeeded, example_report

pytest.importorskip("torch", reason="rvod.torch needs PyTorch (pip install torch) to be tested")
pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")


@pytest.mark.timeout(120)
def test_digits_example_trains_to_high_accuracy(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "torch_digits.py")], timeout=100)
    assert_digits_example_succeeded(result)
    epochs = re.findall(r"^\[0\]<stdout>:\[#+\.*\] +\d+% epoch", result.stdout, re.MULTILINE)
    assert len(epochs) == 12, example_report(result)


@pytest.mark.timeout(120)
def test_synthetic_benchmark_reports_throughput(run_rvodrun):
    args = ["--width", "8", "--image-size", "16", "--batch-size", "8", "--num-warmup-batches", "1",
            "--num-batches-per-iter", "2", "--num-iters", "3", "--fp16-allreduce"]
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "torch_synthetic_benchmark.py"), *args],
                         timeout=100)
    report = example_report(result)
    assert result.returncode == 0, report
    assert len(re.findall(r"^\[0\]<stdout>:Iter #\d: [\d.]+ img/sec per rank$", result.stdout, re.MULTILINE)) == 3
    assert re.search(r"^\[0\]<stdout>:Img/sec per rank: [\d.]+ \+-[\d.]+$", result.stdout, re.MULTILINE), report
    assert re.search(r"^\[0\]<stdout>:Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+$", result.stdout,
                     re.MULTILINE), report


@pytest.mark.timeout(120)
def test_synthetic_benchmark_with_adasum(run_rvodrun):
    """Horovod's --use-adasum: DistributedOptimizer(op=Adasum), learning rate not scaled on one host."""
    args = ["--width", "8", "--image-size", "16", "--batch-size", "8", "--num-warmup-batches", "1",
            "--num-batches-per-iter", "2", "--num-iters", "2", "--use-adasum"]
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "torch_synthetic_benchmark.py"), *args],
                         timeout=100)
    report = example_report(result)
    assert result.returncode == 0, report
    assert re.search(r"^\[0\]<stdout>:Model: .*; ranks: 2; Adasum, lr 0\.01$", result.stdout, re.MULTILINE), report
    assert len(re.findall(r"^\[0\]<stdout>:Iter #\d: [\d.]+ img/sec per rank$", result.stdout, re.MULTILINE)) == 2
    assert re.search(r"^\[0\]<stdout>:Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+$", result.stdout,
                     re.MULTILINE), report
