"""Horovod's op surface for NumPy arrays (and any object with ``__dlpack__``).

Names, argument order and defaults follow ``horovod.torch``, so a script written for it runs on NumPy
data with ``import rvod.numpy as hvd``. Results are NumPy arrays; async ops return integer handles for
``poll`` and ``synchronize``. ``allreduce`` and ``grouped_allreduce`` take a ``compression`` keyword
(``Compression.none``, ``.fp16``, ``.bf16`` where ml_dtypes is installed, ``.int8``, ``.onebit``,
``.powersgd(rank=4)``).
"""

import numpy as _np

from rvod.common import ops as _ops
from rvod.common.compression import compressors as _compressors
from rvod.common.compression import engine_code as _engine_code
from rvod.common.basics import *  # noqa: F401,F403  (the basics: init, rank, size, ...)
from rvod.common.objects import allgather_object, broadcast_object  # noqa: F401
from rvod.common.ops import barrier, join, poll, synchronize
from rvod.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from rvod.exceptions import HorovodInternalError, RvodInternalError, RvodInvalidArgumentError, RvodMismatchError
from rvod.common.numpy_adapter import NumpyAdapter

_adapter = NumpyAdapter()
gps = global_process_set


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


def _is_floating(array):
    dtype = _np.asarray(array).dtype
    return dtype.kind == "f" or dtype == _bfloat16()


def _cast(array, dtype):
    if dtype is None:
        raise RvodInvalidArgumentError("Compression.bf16 on NumPy arrays needs the ml_dtypes package")
    return _np.asarray(array).astype(dtype)


FP16Compressor, BF16Compressor, Compression = _compressors("rvod.numpy", _is_floating, _cast, _np.float16,
                                                           _bfloat16())


def _with_compression(compression, tensors, reduce):
    """``reduce(tensors, code)`` of ``tensors`` compressed by ``compression``, decompressed."""
    compressed = [compression.compress(t) for t in tensors]
    wire = [c for c, _ in compressed]
    reduced = reduce(wire, _engine_code(compression, wire))
    return [compression.decompress(r, context) for r, (_, context) in zip(reduced, compressed)]


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=gps):
    return _ops.allreduce_async(_adapter, tensor, average, name, op, prescale_factor, postscale_factor,
                                process_set)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=gps, compression=Compression.none):
    """Reduce ``tensor`` across ranks (default: Average) into a new array."""
    if compression is Compression.none:
        return _ops.allreduce(_adapter, tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _with_compression(compression, [tensor], lambda wire, code: [_ops.allreduce(
        _adapter, wire[0], average, name, op, prescale_factor, postscale_factor, process_set, compression=code)])[0]


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=gps):
    return _ops.allreduce_async(_adapter, tensor, average, name, op, prescale_factor, postscale_factor,
                                process_set, True)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=gps):
    """Reduce ``tensor`` across ranks in place; returns it."""
    return _ops.allreduce(_adapter, tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=gps):
    return _ops.grouped_allreduce_async(_adapter, tensors, average, name, op, prescale_factor,
                                        postscale_factor, process_set)


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=gps, compression=Compression.none):
    """Reduce a list of arrays as one unit; returns a list of new arrays."""
    if compression is Compression.none:
        return _ops.wait_for(grouped_allreduce_async, tensors, average, name, op, prescale_factor, postscale_factor,
                             process_set)
    return _with_compression(compression, list(tensors), lambda wire, code: _ops.wait_for(
        _ops.grouped_allreduce_async, _adapter, wire, average, name, op, prescale_factor, postscale_factor,
        process_set, False, code))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=gps):
    return _ops.grouped_allreduce_async(_adapter, tensors, average, name, op, prescale_factor,
                                        postscale_factor, process_set, in_place=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=gps):
    return _ops.wait_for(grouped_allreduce_async_, tensors, average, name, op, prescale_factor, postscale_factor,
                         process_set)


def allgather_async(tensor, name=None, process_set=gps):
    return _ops.allgather_async(_adapter, tensor, name, process_set)


def allgather(tensor, name=None, process_set=gps):
    """Concatenate every rank's array along the first dimension (first dimensions may differ)."""
    return _ops.allgather(_adapter, tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=gps):
    return _ops.grouped_allgather_async(_adapter, tensors, name, process_set)


def grouped_allgather(tensors, name=None, process_set=gps):
    return _ops.wait_for(grouped_allgather_async, tensors, name, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=gps):
    return _ops.broadcast_async(_adapter, tensor, root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=gps):
    """Return ``root_rank``'s array on every rank."""
    return _ops.broadcast(_adapter, tensor, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=gps):
    return _ops.broadcast_async(_adapter, tensor, root_rank, name, process_set, in_place=True)


def broadcast_(tensor, root_rank, name=None, process_set=gps):
    """Overwrite ``tensor`` with ``root_rank``'s values; returns it."""
    return _ops.broadcast(_adapter, tensor, root_rank, name, process_set, True)


def alltoall_async(tensor, splits=None, name=None, process_set=gps):
    return _ops.alltoall_async(_adapter, tensor, splits, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=gps):
    """Send ``splits[i]`` rows of dim 0 to rank i (even split when None) and gather what others send.
    Returns the output, or ``(output, received_splits)`` when ``splits`` is given."""
    return _ops.wait_for(alltoall_async, tensor, splits, name, process_set)


def reducescatter_async(tensor, name=None, op=Average, process_set=gps, prescale_factor=1.0,
                        postscale_factor=1.0, output=None):
    """Start a reducescatter; ``output`` (rvod's own): a contiguous writable array of ``tensor``'s dtype with
    this rank's share's number of elements, which receives the result (``synchronize`` returns it)."""
    return _ops.reducescatter_async(_adapter, tensor, name, op, process_set, prescale_factor, postscale_factor,
                                    output)


def reducescatter(tensor, name=None, op=Average, process_set=gps, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce across ranks, then give rank r its share of dim 0 (the first ranks take the extra rows)."""
    return _ops.wait_for(reducescatter_async, tensor, name, op, process_set, prescale_factor, postscale_factor)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=gps, prescale_factor=1.0,
                                postscale_factor=1.0):
    return _ops.grouped_reducescatter_async(_adapter, tensors, name, op, process_set, prescale_factor,
                                            postscale_factor)


def grouped_reducescatter(tensors, name=None, op=Average, process_set=gps, prescale_factor=1.0,
                          postscale_factor=1.0):
    return _ops.wait_for(grouped_reducescatter_async, tensors, name, op, process_set, prescale_factor,
                         postscale_factor)

