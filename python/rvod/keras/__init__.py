"""rvod for Keras 3: ``import rvod.keras as hvd`` in place of ``import horovod.keras as hvd`` or
``import horovod.tensorflow.keras as hvd`` (``rvod.tensorflow.keras`` is this module).

``DistributedOptimizer`` wraps a Keras 3 optimizer so that ``model.fit`` averages gradients across ranks;
the callbacks in ``rvod.keras.callbacks`` broadcast the initial state, average metrics and warm up or
schedule the learning rate; ``load_model`` loads a saved model with its optimizer wrapped. The TensorFlow
backend is the main one; the torch backend works through ``rvod.torch`` where Keras allows it.
"""

import keras
import numpy as np

import rvod.numpy as _np_ops
from rvod.common.basics import *  # noqa: F401,F403  (the basics, re-exported)
from rvod.common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from rvod.exceptions import (  # noqa: F401
    HorovodInternalError,
    RvodInternalError,
    RvodInvalidArgumentError,
    RvodMismatchError,
    RvodTimeoutError,
)
from rvod.keras import callbacks, elastic
from rvod.keras.callbacks import broadcast_optimizer, broadcast_variables
from rvod.keras.compression import Compression
from rvod.keras.optimizer import DistributedOptimizer


def broadcast_global_variables(root_rank, model=None):
    """Assign ``root_rank``'s values to ``model``'s variables and its optimizer's (for a sharded optimizer its
    ``broadcast_state``). Keras 3 has no global variable collection, so the model must be given (or use
    ``BroadcastGlobalVariablesCallback``)."""
    if model is None:
        raise RuntimeError("Keras 3 keeps no global variables: call broadcast_global_variables(root_rank, model) "
                           "or use callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit")
    broadcast_variables(list(model.variables), root_rank)
    broadcast_optimizer(model.optimizer, root_rank)


def _as_array(value):
    return np.array(keras.ops.convert_to_numpy(value), order="C")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """The reduction of ``value`` (tensor, array or number) across ranks, as a NumPy array (default:
    Average). ``compression`` is accepted for Horovod's signature; values are sent as they are."""
    return _np_ops.allreduce(_as_array(value), average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce(values, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
                      compression=Compression.none):
    """The reductions of ``values`` (a list of tensors, arrays or numbers) across ranks as one fused unit, as
    a list of NumPy arrays (default: Average). Horovod's Keras module has only ``allreduce``; this takes
    the same arguments, as ``grouped_allreduce`` does in the other frameworks."""
    return _np_ops.grouped_allreduce([_as_array(v) for v in values], average, name, op, prescale_factor,
                                     postscale_factor)


def allgather(value, name=None):
    """Every rank's ``value`` concatenated along the first dimension, as a NumPy array."""
    return _np_ops.allgather(_as_array(value), name)


def broadcast(value, root_rank, name=None):
    """``root_rank``'s ``value``, as a NumPy array."""
    return _np_ops.broadcast(_as_array(value), root_rank, name)


def reducescatter(value, name=None, op=Average):
    """``value`` reduced across ranks, this rank's share of the first dimension, as a NumPy array."""
    return _np_ops.reducescatter(_as_array(value), name, op)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False, sharded=False):
    """``keras.models.load_model`` whose optimizer comes back wrapped in ``DistributedOptimizer`` with its
    saved state (slots and iteration count). ``custom_optimizers`` are optimizer classes the file may name.
    ``sharded=True``: a sharded ``DistributedOptimizer`` that keeps this rank's slice of the saved state (a
    plain optimizer's, as a sharded one's ``model.save()`` writes it too)."""
    objects = dict(custom_objects or {})
    for optimizer_class in custom_optimizers or []:
        objects[optimizer_class.__name__] = optimizer_class
    model = keras.models.load_model(filepath, custom_objects=objects)
    loaded = getattr(model, "optimizer", None)
    if loaded is None:
        return model
    wrapped = DistributedOptimizer(loaded, compression=compression, sharded=sharded)
    if loaded.built:
        wrapped.build(model.trainable_variables)
        if sharded:
            wrapped.load_state_dict([_as_array(v) for v in loaded.variables])
        else:
            for target, source in zip(wrapped.variables, loaded.variables):
                target.assign(source)
    model.optimizer = wrapped
    model.train_function = None
    return model


from rvod.common.basics import __all__ as _basics  # noqa: E402

__all__ = _basics + [
    "DistributedOptimizer", "broadcast_global_variables", "broadcast_variables", "allreduce", "grouped_allreduce",
    "allgather",
    "broadcast", "reducescatter", "load_model", "callbacks", "Compression", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "elastic",
]
