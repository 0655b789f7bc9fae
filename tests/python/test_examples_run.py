"""Every script in examples/ runs in a test (issue 36 item 6): the scripts no framework test runs are run
here with small settings, asserting their own printed results; and a check that each example is named by
some test, so a new one cannot rot unseen."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TESTS = Path(__file__).resolve().parent
# Modules the examples import rather than scripts (run through the examples that import them).
NOT_SCRIPTS = {"cluster_digits.py", "estimator_digits.py"}


def test_every_example_is_run_by_some_test():
    tests = "\n".join(path.read_text() for path in TESTS.glob("test_*.py"))
    unrun = [path.name for path in sorted(EXAMPLES.glob("*.py"))
             if path.name not in NOT_SCRIPTS and path.stem not in tests]
    assert unrun == [], f"examples no test runs: {unrun}"


def accuracies(output: str) -> dict[int, float]:
    return {int(rank): float(acc) for rank, acc in re.findall(r"^rank (\d+): test accuracy ([\d.]+)", output, re.M)}


@pytest.mark.timeout(120)
def test_numpy_digits(run_rvodrun):
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "numpy_digits.py"), "--epochs", "8"],
                         timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    final = re.search(r"trained on 2 ranks in [\d.]+ s; final test accuracy ([\d.]+)", result.stdout)
    assert final and float(final.group(1)) >= 0.9, result.stdout[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", ["ray_torch_digits.py", "spark_torch_digits.py"])
def test_ray_and_spark_digits(job_env, example):
    """Each starts its own local cluster (Ray with 2 CPUs, Spark local[2]) and trains on 2 workers."""
    result = subprocess.run([sys.executable, str(EXAMPLES / example), "-np", "2", "--epochs", "12"], env=job_env,
                            capture_output=True, text=True, timeout=230, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    found = accuracies(result.stdout)
    assert sorted(found) == [0, 1] and min(found.values()) >= 0.9, result.stdout[-3000:]


@pytest.mark.timeout(240)
def test_ray_elastic_digits(job_env):
    """examples/ray_elastic_digits.py on a local Ray instance of 2 CPUs: 2 workers train elastically; rank 0's
    ray_logger lines reach the driver's callback, every epoch at 2 workers, and both ranks end equally accurate."""
    result = subprocess.run([sys.executable, str(EXAMPLES / "ray_elastic_digits.py"), "--num-cpus", "2", "--epochs", "6"],
                            env=job_env, capture_output=True, text=True, timeout=230, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    epochs = re.findall(r"^epoch (\d+): (\d+) workers, mean loss ([\d.]+)", result.stdout, re.M)
    assert [(int(epoch), int(workers)) for epoch, workers, _ in epochs] == [(epoch, 2) for epoch in range(6)]
    assert float(epochs[-1][2]) < float(epochs[0][2]), result.stdout
    found = accuracies(result.stdout)
    assert sorted(found) == [0, 1] and min(found.values()) >= 0.9 and len(set(found.values())) == 1, result.stdout
