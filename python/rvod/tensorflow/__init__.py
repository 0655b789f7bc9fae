"""rvod for TensorFlow 2: ``import rvod.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd``.

The names are ``horovod.tensorflow``'s: collectives on CPU tensors that work eagerly and inside
``tf.function`` with Horovod's gradients, ``DistributedGradientTape``, ``DistributedOptimizer`` (Keras
optimizers), ``broadcast_variables``, ``broadcast_object``, ``allgather_object``, ``Compression`` and the
basics; ``rvod.tensorflow.keras`` is ``rvod.keras``. Tensors cross to the engine through DLPack, so no
TensorFlow op is compiled and one wheel serves every TensorFlow version.
"""

from rvod.exceptions import HorovodInternalError, RvodInternalError, RvodMismatchError, RvodTimeoutError
from rvod.tensorflow import mpi_ops
from rvod.tensorflow.adapter import MismatchError
from rvod.tensorflow.compression import Compression
from rvod.tensorflow.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from rvod.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from rvod.tensorflow.mpi_ops import *  # noqa: F401,F403  (the basics and the collectives)
from rvod.tensorflow.mpi_ops import __all__ as _ops_names
from rvod.tensorflow.mpi_ops import Average, _executing_eagerly, global_process_set  # noqa: F401


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so that it applies gradients averaged (``op``) across ranks; the same as
    ``rvod.keras.DistributedOptimizer``. TensorFlow 1 optimizers (``tf.compat.v1.train``) are not
    supported: use a Keras optimizer, or DistributedGradientTape."""
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"rvod.tensorflow.DistributedOptimizer wraps a Keras optimizer, got "
                        f"{type(optimizer).__name__}; for a custom loop use DistributedGradientTape")
    from rvod.keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                     gradient_predivide_factor, op, backward_passes_per_step,
                                     average_aggregated_gradients, num_groups, groups, process_set,
                                     scale_local_gradients)


__all__ = _ops_names + [
    "Compression", "allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "broadcast_global_variables", "HorovodInternalError", "RvodInternalError", "RvodMismatchError",
    "RvodTimeoutError", "MismatchError", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "mpi_ops",
]
