"""rvod: distributed deep-learning training with Horovod's API and a Rust engine.

Change ``import horovod.torch as hvd`` to ``import rvod.torch as hvd`` (or ``rvod.numpy``,
``rvod.tensorflow``, ``rvod.keras``, ``rvod.mxnet``; ``rvod.jax`` for JAX, which Horovod never had) and
launch with ``rvodrun -np N python train.py``.
``rvod.run(fn, np=N, hosts=...)`` runs a function on every rank, as ``horovod.run`` does.
Importing ``rvod`` itself imports no deep-learning framework (nor the native extension).
"""

import importlib.metadata

from rvod.exceptions import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RvodError,
    RvodInternalError,
    RvodInvalidArgumentError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.runner.run_func import run

try:
    # Written once, in Cargo.toml: maturin puts it into the installed package's metadata.
    __version__ = importlib.metadata.version("rvod")
except importlib.metadata.PackageNotFoundError:  # the source tree, not installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "RvodError",
    "RvodInternalError",
    "RvodInvalidArgumentError",
    "RvodMismatchError",
    "RvodTimeoutError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "run",
]
