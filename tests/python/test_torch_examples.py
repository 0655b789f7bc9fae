"""The PyTorch examples run under rvodrun with 2 ranks: the digits CNN reaches its accuracy, the synthetic
benchmark prints Horovod's report (here with a tiny model and few batches) and the Adasum small-model
experiment converges; both take Horovod's command lines. The calls Horovod's two scripts make
(examples/pytorch/pytorch_synthetic_benchmark.py, examples/adasum/adasum_small_model.py) have Horovod's
signatures in rvod.torch."""

from __future__ import annotations

import inspect
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
    args = ["--model", "small_resnet", "--width", "8", "--image-size", "16", "--batch-size", "8",
            "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "3", "--fp16-allreduce",
            "--no-cuda"]
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
    """Horovod's --use-adasum (with --fp16-allreduce): DistributedOptimizer(op=Adasum), learning rate not
    scaled on one host."""
    args = ["--width", "8", "--image-size", "16", "--batch-size", "8", "--num-warmup-batches", "1",
            "--num-batches-per-iter", "2", "--num-iters", "2", "--use-adasum", "--fp16-allreduce"]
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "torch_synthetic_benchmark.py"), *args],
                         timeout=100)
    report = example_report(result)
    assert result.returncode == 0, report
    assert re.search(r"^\[0\]<stdout>:Model: .*; ranks: 2 on \w+; Adasum, lr 0\.01$", result.stdout, re.MULTILINE), report
    assert len(re.findall(r"^\[0\]<stdout>:Iter #\d: [\d.]+ img/sec per rank$", result.stdout, re.MULTILINE)) == 2
    assert re.search(r"^\[0\]<stdout>:Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+$", result.stdout,
                     re.MULTILINE), report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, op", [("square", "Adasum"), ("cubic", "Average")])
def test_adasum_small_model_takes_horovods_command_line(run_rvodrun, mode, op):
    """The command line of Horovod's adasum_bench notebook; rank 0 alone prints its one result line. The
    square model with Adasum converges (the combined gradient exactly zero twice) within 50 steps."""
    args = [f"--mode={mode}", "--x_max=1.000000", f"--op={op}", "--learning_rate=0.500000"]
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "adasum_small_model.py"), *args], timeout=100)
    report = example_report(result)
    assert result.returncode == 0, report
    lines = re.findall(r"^\[(\d)\]<stdout>:(.*)$", result.stdout, re.MULTILINE)
    assert len(lines) == 1 and lines[0][0] == "0", report
    found = re.fullmatch(rf"1\.0 {op} 0\.5 2 (\d+)", lines[0][1])
    assert found, report
    steps = int(found.group(1))
    assert steps < 50 if mode == "square" else steps <= 50 or steps == 100, report


def parameters(function):
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_horovods_script_calls_have_horovods_signatures():
    """Each rvod.torch call of Horovod's synthetic benchmark and Adasum small-model scripts, with Horovod's
    parameters and defaults (rvod may add parameters at the end)."""
    import rvod.torch as hvd

    everyone = hvd.global_process_set
    expected = {
        "init": [("comm", None)],
        "allreduce": [("tensor", inspect.Parameter.empty), ("average", None), ("name", None),
                      ("compression", hvd.Compression.none), ("op", None), ("prescale_factor", 1.0),
                      ("postscale_factor", 1.0), ("process_set", everyone)],
        "DistributedOptimizer": [("optimizer", inspect.Parameter.empty), ("named_parameters", None),
                                 ("compression", hvd.Compression.none), ("backward_passes_per_step", 1),
                                 ("op", hvd.Average), ("gradient_predivide_factor", 1.0), ("num_groups", 0),
                                 ("groups", None), ("sparse_as_dense", False), ("process_set", everyone)],
        "broadcast_parameters": [("params", inspect.Parameter.empty), ("root_rank", inspect.Parameter.empty)],
        "broadcast_optimizer_state": [("optimizer", inspect.Parameter.empty),
                                      ("root_rank", inspect.Parameter.empty)],
        "SyncBatchNorm": [("num_features", inspect.Parameter.empty), ("eps", 1e-05), ("momentum", 0.1),
                          ("affine", True), ("track_running_stats", True)],
        "rank": [], "size": [], "local_rank": [], "local_size": [], "nccl_built": [],
    }
    for name, want in expected.items():
        got = parameters(getattr(hvd, name))
        assert got[:len(want)] == want, f"{name}: {got}"
    assert hvd.Compression.fp16 is not hvd.Compression.none
    assert (hvd.Average, hvd.Adasum) == (0, 2)
