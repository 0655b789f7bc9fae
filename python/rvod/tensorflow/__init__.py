"""rvod for TensorFlow 2: ``import rvod.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd``.

The names are ``horovod.tensorflow``'s: collectives on CPU tensors that work eagerly, inside
``tf.function`` and in tf.compat.v1 graphs run by a Session, with Horovod's gradients;
``DistributedGradientTape``, ``DistributedOptimizer`` (Keras and ``tf.compat.v1.train`` optimizers),
``broadcast_variables``, ``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook`` (TensorFlow 1
graphs), ``broadcast_object``, ``allgather_object``, ``SyncBatchNormalization``, ``Compression`` and the
basics; ``rvod.tensorflow.keras`` is ``rvod.keras``; ``rvod.tensorflow.data`` is Horovod's tf.data compute
service (docs/tf-data-service.md). Tensors cross to the engine through DLPack, so no
TensorFlow op is compiled and one wheel serves every TensorFlow version.
"""

import tensorflow as tf

from rvod.exceptions import (
    HorovodInternalError,
    RvodInternalError,
    RvodInvalidArgumentError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.tensorflow import mpi_ops
from rvod.tensorflow.adapter import MismatchError
from rvod.tensorflow.compression import Compression
from rvod.tensorflow.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from rvod.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from rvod.tensorflow.legacy_optimizer import DistributedLegacyOptimizer
from rvod.tensorflow.mpi_ops import *  # noqa: F401,F403  (the basics and the collectives)
from rvod.tensorflow.mpi_ops import __all__ as _ops_names
from rvod.tensorflow.mpi_ops import Adasum, Average, _executing_eagerly, global_process_set  # noqa: F401



class _NotAnOptimizerError(ValueError, TypeError):
    """What DistributedOptimizer raises for something that is not an optimizer: Horovod raises ValueError,
    earlier rvod versions TypeError; either catches it."""


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True, sharded=False):
    """Wrap an optimizer so that it applies gradients averaged (``op``) across ranks: a TensorFlow 1
    optimizer (``tf.compat.v1.train.Optimizer``, whose ``compute_gradients`` then reduces them, in a
    graph or eagerly; with ``op=Adasum`` its ranks combine their updates instead:
    ``rvod.tensorflow.adasum_legacy_optimizer``) or a Keras optimizer (the same as
    ``rvod.keras.DistributedOptimizer``, which takes ``sharded=True``)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if sharded:
            raise ValueError("sharded=True takes a Keras 3 optimizer, not a tf.compat.v1.train.Optimizer")
        if op == Adasum:
            from rvod.tensorflow.adasum_legacy_optimizer import DistributedAdasumLegacyOptimizer

            return DistributedAdasumLegacyOptimizer(optimizer, name, use_locking, compression,
                                                    backward_passes_per_step, process_set)
        return DistributedLegacyOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                          gradient_predivide_factor, num_groups, groups, process_set,
                                          scale_local_gradients, backward_passes_per_step,
                                          average_aggregated_gradients)
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise _NotAnOptimizerError(f"DistributedOptimizer wraps a tf.compat.v1.train.Optimizer or a Keras optimizer, "
                                   f"got {type(optimizer).__name__}; for a custom loop use DistributedGradientTape")
    from rvod.keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                     gradient_predivide_factor, op, backward_passes_per_step,
                                     average_aggregated_gradients, num_groups, groups, process_set,
                                     scale_local_gradients, sharded)


def __getattr__(name):
    # Imported on first use: it imports Keras, which a script using only the collectives need not load.
    if name == "SyncBatchNormalization":
        from rvod.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    if name == "elastic":
        import rvod.tensorflow.elastic as elastic

        return elastic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = _ops_names + [
    "Compression", "allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "broadcast_global_variables", "HorovodInternalError", "RvodInternalError", "RvodInvalidArgumentError", "RvodMismatchError",
    "RvodTimeoutError", "MismatchError", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "BroadcastGlobalVariablesHook", "SyncBatchNormalization", "mpi_ops",
    "elastic",
]
