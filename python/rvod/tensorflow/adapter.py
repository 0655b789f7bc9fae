"""TensorFlow tensors across the DLPack boundary, and the error class TensorFlow users catch.

An eager CPU tensor crosses without a copy (``tf.experimental.dlpack``: the capsule keeps TensorFlow's
buffer alive until the engine is done with it); variables, NumPy arrays and Python values are converted to
a tensor first. Results come back as tensors viewing the engine's output buffer. A tensor on a GPU is copied
to the host first (TensorFlow's DLPack export gives no stream to order rvod's reads after, so the engine does
not take its device memory) and its result is a host tensor, which TensorFlow copies to the GPU where a GPU
op uses it, as Horovod built without GPU operations did. Dtypes the engine cannot exchange are refused with
``RvodInvalidArgumentError`` (a ``ValueError`` and a ``RuntimeError``) before anything is sent; inside a graph TensorFlow reports it as
``tf.errors.InvalidArgumentError``, as it does every ``ValueError``.
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dlpack

from rvod.common.ops import TensorAdapter
from rvod.exceptions import RvodInvalidArgumentError, RvodMismatchError

SUPPORTED_DTYPES = (tf.uint8, tf.uint16, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
                    tf.float64, tf.bool)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)


class MismatchError(RvodMismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagreed about a tensor. Eagerly, TensorFlow code catches it as Horovod's
    ``tf.errors.FailedPreconditionError`` and rvod code as ``RvodMismatchError``; inside a ``tf.function``
    TensorFlow reports it as ``tf.errors.InvalidArgumentError`` (it maps every ``ValueError`` so)."""

    def __init__(self, message):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


def check_dtype(dtype, what="rvod"):
    """Raise unless the engine exchanges tensors of ``dtype``."""
    if dtype not in _SUPPORTED and tf.as_dtype(dtype) not in _SUPPORTED:
        raise RvodInvalidArgumentError(f"{what}: tensors of dtype {tf.as_dtype(dtype).name} are not supported; "
                         f"supported: {_SUPPORTED_NAMES}")


def as_tensor(value, what="rvod"):
    """``value`` (tensor, variable, NumPy array, Python number or list) as a tensor of a supported dtype."""
    if isinstance(value, tf.Tensor):
        tensor = value
    elif isinstance(value, (tf.IndexedSlices, tf.SparseTensor, tf.RaggedTensor)):
        raise RvodInvalidArgumentError(f"{what}: {type(value).__name__} is not supported here; convert it to a dense tensor")
    else:
        tensor = tf.convert_to_tensor(value)
    check_dtype(tensor.dtype, what)
    return tensor


def on_host(tensor):
    """``tensor`` itself where it is in host memory, else a copy of it there (TensorFlow orders the copy after
    the work that produces the tensor on its device)."""
    device = tensor.device  # e.g. "/job:localhost/replica:0/task:0/device:GPU:0"
    if not device or device.rpartition("device:")[2].partition(":")[0].upper() in ("", "CPU"):
        return tensor
    with tf.device("/CPU:0"):
        return tf.identity(tensor)


class TensorFlowAdapter(TensorAdapter):
    def export(self, tensor):
        tensor = on_host(as_tensor(tensor))
        return dlpack.to_dlpack(tensor), tensor

    def from_dlpack(self, capsule):
        return dlpack.from_dlpack(capsule)

    def to_int_list(self, values):
        if isinstance(values, (tf.Tensor, tf.Variable, np.ndarray)):
            return [int(v) for v in np.asarray(values).reshape(-1)]
        return [int(v) for v in values]

    def received_splits(self, splits):
        return tf.constant(list(splits), dtype=tf.int32)
