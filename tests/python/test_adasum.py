"""Adasum end to end on 2, 3, 4 and 5 ranks (rvodrun): rvod.numpy and rvod.torch allreduce against a NumPy
reference of the formula and combination order, orthogonal and parallel vectors against their closed forms,
grouped equals per tensor, a process set, refusals, and torch's DistributedOptimizer(op=Adasum) (3 ranks:
exact steps on every rank and on a process set of two, training on the digits data); then TensorFlow and
Keras (rvod.keras allreduce and grouped_allreduce, the optimizers, also on a process set of two of 3 ranks).
The workers are workers/adasum.py and workers/tensorflow_adasum.py.
"""
from __future__ import annotations

import pytest
from jobs import PYTHON, WORKERS, failures, verdicts

WORKER = str(WORKERS / "adasum.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_adasum_matches_the_reference_and_trains(run_rvodrun, size):
    """Every size checks the collectives; 3 ranks (folding one rank in first) also steps and trains."""
    result = run_rvodrun(["-np", str(size), PYTHON, WORKER, *(["train"] if size == 3 else [])], timeout=110)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    found = verdicts(result.stdout)
    assert set(found) == set(range(size)), report
    assert all(failed == 0 for _, failed in found.values()), report
    assert min(passed for passed, _ in found.values()) >= (14 if size == 3 else 10), report
    assert result.returncode == 0, report


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 3])
def test_tensorflow_and_keras_adasum_optimizers_match_the_reference(run_rvodrun, size):
    """rvod.keras allreduce and grouped_allreduce with op=Adasum; TensorFlow 1 (graph and eager) and Keras 3
    DistributedOptimizer(op=Adasum): the combined updates against the reference, backward_passes_per_step 2,
    a process set of two of 3 ranks (the third stepping alone), and Keras fit on the digits data."""
    result = run_rvodrun(["-np", str(size), PYTHON, str(WORKERS / "tensorflow_adasum.py")], timeout=140)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    found = verdicts(result.stdout)
    assert set(found) == set(range(size)), report
    assert all(failed == 0 and passed == (14 if size == 3 else 10) for passed, failed in found.values()), report
    assert result.returncode == 0, report
