"""rvod for PyTorch: ``import rvod.torch as hvd`` in place of ``import horovod.torch as hvd``.

The names are ``horovod.torch``'s (collectives, DistributedOptimizer, broadcast helpers, Compression,
SyncBatchNorm, the basics); rvod adds ``Compression.bf16`` and its own exception classes. CUDA tensors run
through NCCL or host staging; where no GPU is usable (no driver, no CUDA runtime or NCCL found) the engine
says why, naming the tensor (README, "GPU status").
"""

from rvod.exceptions import (
    HorovodInternalError,
    RvodInternalError,
    RvodInvalidArgumentError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.torch import mpi_ops
from rvod.torch.compression import Compression
from rvod.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from rvod.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ProcessSet,
    Sum,
    _check_has_gpu,  # noqa: F401  (private, but Horovod scripts and tests call it)
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    straggler_report,
    synchronize,
)
from rvod.torch.optimizer import DistributedOptimizer
from rvod.torch.sync_batch_norm import SyncBatchNorm
from rvod.torch import elastic  # noqa: E402  (hvd.elastic; needs the names above)

__all__ = [
    "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "straggler_report", "size",
    "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "HorovodInternalError", "DistributedOptimizer", "SyncBatchNorm", "mpi_ops",
    "RvodInternalError", "RvodInvalidArgumentError", "RvodMismatchError", "RvodTimeoutError", "elastic",
]
