"""Every collective of rvod.numpy, rvod.torch, rvod.tensorflow and rvod.jax, one test item per case of
collective_cases.py: op x reduce op or root x dtype x variant x job size (2 and 3 ranks; TensorFlow and JAX 2), for
NumPy over shared memory and over TCP. `pytest -k allgather-int8-3ranks` runs the cases whose id contains it (in one
small job per framework); a full run starts one rvodrun job per framework, transport and job size.
rvod.mxnet runs the same cases in its own environment (test_mxnet_collective_cases.py).
"""

from __future__ import annotations

import importlib.util

import pytest
from collective_suite import ITEM_TIMEOUT, assert_case_passed, collective_jobs, parameters  # noqa: F401

INSTALLED = [name for name in ("numpy", "torch", "tensorflow", "jax") if importlib.util.find_spec(name) is not None]


@pytest.mark.timeout(ITEM_TIMEOUT)
@pytest.mark.parametrize("group, case", parameters(INSTALLED))
def test_collective(collective_jobs, group, case):  # noqa: F811
    assert_case_passed(collective_jobs(group), group, case)
