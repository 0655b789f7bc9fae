"""rvod for JAX: Horovod's API for jax.Array, ``import rvod.jax as hvd``.

Horovod has no JAX shim; the names are ``horovod.torch``'s where JAX has the same thing: the basics
(``init``, ``rank``, ``size``, ...), ``allreduce``, ``grouped_allreduce``, ``allgather``,
``grouped_allgather``, ``broadcast``, ``alltoall``, ``reducescatter``, ``grouped_reducescatter``,
``barrier``, ``join`` and process sets, eagerly and inside ``jax.jit`` (including ``lax.scan`` and donated
buffers), differentiable with Horovod's gradients (``mpi_ops``); ``broadcast_parameters`` and
``broadcast_optimizer_state`` of pytrees, ``broadcast_object`` and ``allgather_object`` (``functions``);
``DistributedOptimizer``, a wrapper of an optax ``GradientTransformation`` (``optimizer``). Arrays cross to
the engine by DLPack (``adapter``), so no XLA op is compiled and one wheel serves every JAX version.
There are no in-place or ``*_async`` ops: jax.Arrays are immutable and JAX dispatches asynchronously itself.
"""

from rvod.exceptions import (
    HorovodInternalError,
    RvodInternalError,
    RvodInvalidArgumentError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.jax import mpi_ops
from rvod.jax.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from rvod.jax.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ProcessSet,
    Sum,
    add_process_set,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    reducescatter,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    straggler_report,
)
from rvod.jax.optimizer import DistributedOptimizer

__all__ = [
    "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall", "reducescatter",
    "grouped_reducescatter", "join", "barrier", "init", "shutdown", "is_initialized", "start_timeline", "straggler_report",
    "stop_timeline", "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "DistributedOptimizer", "mpi_ops",
    "HorovodInternalError", "RvodInternalError", "RvodInvalidArgumentError", "RvodMismatchError",
    "RvodTimeoutError",
]
