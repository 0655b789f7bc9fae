"""rvod for MXNet 1.9: ``import rvod.mxnet as hvd`` in place of ``import horovod.mxnet as hvd``.

The names are ``horovod.mxnet``'s (collectives on CPU NDArrays with its argument orders,
DistributedOptimizer for the Module API, DistributedTrainer for Gluon, broadcast_parameters including
deferred-initialized Gluon parameters, broadcast_object, allgather_object, Compression, the basics);
rvod adds ``join``, ``barrier`` and its own exception classes. NDArrays cross to the engine through
DLPack; nothing is compiled against MXNet.
"""

from rvod.exceptions import (
    HorovodInternalError,
    RvodInternalError,
    RvodInvalidArgumentError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.mxnet import mpi_ops
from rvod.mxnet.compression import Compression
from rvod.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from rvod.mxnet.mpi_ops import *  # noqa: F403  (the basics, process sets, reduce ops and collectives)
from rvod.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [
    *mpi_ops.__all__, "mpi_ops", "Compression", "allgather_object", "broadcast_object", "broadcast_parameters",
    "DistributedOptimizer", "DistributedTrainer", "HorovodInternalError", "RvodInternalError", "RvodMismatchError",
    "RvodInvalidArgumentError", "RvodTimeoutError",
]
