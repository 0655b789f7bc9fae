"""rvod: distributed deep-learning training with Horovod's API and a Rust engine.

Change ``import horovod.torch as hvd`` to ``import rvod.torch as hvd`` (or ``rvod.numpy``,
``rvod.tensorflow``, ``rvod.keras``, ``rvod.mxnet``) and launch with ``rvodrun -np N python train.py``.
``rvod.run(fn, np=N, hosts=...)`` runs a function on every rank, as ``horovod.run`` does.
Importing ``rvod`` itself imports no deep-learning framework.
"""

from rvod.exceptions import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RvodError,
    RvodInternalError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.runner.run_func import run

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "RvodError",
    "RvodInternalError",
    "RvodMismatchError",
    "RvodTimeoutError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "run",
]
