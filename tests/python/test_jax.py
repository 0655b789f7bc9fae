"""Multi-process tests of rvod.jax, run through rvodrun with 2 and 3 ranks (one job each, JAX imports and
compiles slowly): workers/jax_ops.py checks what the collective cases (test_collectives.py, every op x
dtype eagerly) leave out: every op and dtype inside jax.jit, Horovod's gradients through jax.grad, ops inside
lax.scan and with donated buffers, process sets, the broadcast helpers, errors eagerly and inside jit, an MLP
trained with DistributedOptimizer on 2 ranks equal to one process on the global batch, and a dead peer; and
examples/jax_digits.py reaches its accuracy."""

from __future__ import annotations

import sys

import pytest
from jobs import EXAMPLES, WORKERS, assert_digits_example_succeeded, assert_worker_job

pytest.importorskip("jax", reason="rvod.jax needs JAX (pip install jax optax) to be tested")
pytest.importorskip("optax", reason="rvod.jax's DistributedOptimizer needs optax (pip install optax) to be tested")

# Checks per rank: the last rank dies before the dead-peer check; only the 2-rank job trains the MLP.
CHECKS = {2: {0: 40, 1: 39}, 3: {0: 39, 1: 39, 2: 38}}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [2, 3])
def test_jax_ops_gradients_training_and_errors(run_rvodrun, ranks):
    result = run_rvodrun(["-np", str(ranks), sys.executable, str(WORKERS / "jax_ops.py")], timeout=130)
    assert_worker_job(result, CHECKS[ranks])


@pytest.mark.timeout(120)
def test_digits_example_trains_to_high_accuracy(run_rvodrun):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "jax_digits.py"), "--epochs", "5"], timeout=100)
    assert_digits_example_succeeded(result)
