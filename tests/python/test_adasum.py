"""Adasum end to end on 2, 3 and 4 ranks (rvodrun): rvod.numpy and rvod.torch allreduce against a NumPy
reference of the formula and combination order, grouped equals per tensor, a process set, refusals, and
torch's DistributedOptimizer(op=Adasum) training on the digits data. The worker is workers/adasum.py.
About 30 s in all on 2 idle cores (70 s on 2 cores shared with other jobs).
"""

from __future__ import annotations

import pytest
from jobs import PYTHON, WORKERS, failures, verdicts

WORKER = str(WORKERS / "adasum.py")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_adasum_matches_the_reference_and_trains(run_rvodrun, size):
    """Every size checks the collectives; 3 ranks (folding one rank in first) also trains."""
    result = run_rvodrun(["-np", str(size), PYTHON, WORKER, *(["train"] if size == 3 else [])], timeout=80)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    found = verdicts(result.stdout)
    assert set(found) == set(range(size)), report
    assert all(failed == 0 for _, failed in found.values()), report
    assert min(passed for passed, _ in found.values()) >= (12 if size == 3 else 9), report
    assert result.returncode == 0, report


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 3])
def test_tensorflow_and_keras_adasum_optimizers_match_the_reference(run_rvodrun, size):
    """TensorFlow 1 (graph and eager) and Keras 3 DistributedOptimizer(op=Adasum): the combined updates
    against the reference, backward_passes_per_step 2, and Keras fit on the digits data."""
    result = run_rvodrun(["-np", str(size), PYTHON, str(WORKERS / "tensorflow_adasum.py")], timeout=140)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    found = verdicts(result.stdout)
    assert set(found) == set(range(size)), report
    assert all(failed == 0 and passed == 9 for passed, failed in found.values()), report
    assert result.returncode == 0, report
