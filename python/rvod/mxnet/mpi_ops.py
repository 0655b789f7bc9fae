"""Horovod's collective ops on MXNet NDArrays (``mx.nd`` and ``mx.np``).

Names, argument orders and defaults are ``horovod.mxnet``'s, which differ from torch's: every op takes a
``priority`` after ``name``, ``op`` comes last in ``allreduce`` and second in ``reducescatter``. Each op
returns once its result is complete, so results can be read at once (Horovod queues the op on MXNet's
engine instead; either way the script sees the same values). ``priority`` is accepted and has no effect:
rvod's engine starts whatever every rank has submitted, in submission order. ``*_`` ops write their
result into their input and return it.

An op refused at submission (bad ``alltoall`` splits, Adasum in ``reducescatter``, no tensors ...) raises
``MXNetArgumentError``, which is an ``MXNetError`` as horovod.mxnet raises (its checks run inside the op)
and also an ``RvodInvalidArgumentError`` (a ``ValueError`` and a ``RuntimeError``), as rvod's refusals are.
"""

import numbers

import mxnet as mx
import numpy as np

from rvod.common import basics as _basics
from rvod.common import ops as _ops
from rvod.common.basics import *  # noqa: F403  (Horovod's basics: init, rank, size, ...)
from rvod.common.basics import is_homogeneous  # noqa: F401  (hvd.mpi_ops.is_homogeneous, as in Horovod)
from rvod.common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from rvod.exceptions import RvodInvalidArgumentError
from rvod.mxnet.adapter import adapter_for, dtype_name

# horovod.mxnet offers is_homogeneous only as hvd.mpi_ops.is_homogeneous, not at the top level.
__all__ = [
    *(name for name in _basics.__all__ if name != "is_homogeneous"), "ProcessSet", "add_process_set", "global_process_set", "remove_process_set", "Adasum",
    "Average", "Max", "Min", "Product", "Sum", "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter",
    "join", "barrier", "MXNetArgumentError",
]

_synchronize = _ops.synchronize


class MXNetArgumentError(RvodInvalidArgumentError, mx.base.MXNetError):
    """An argument an op cannot take, refused before anything is sent (the same on every rank)."""


def refusing_as_mxnet(call, *args, **kwargs):
    """``call(*args, **kwargs)``; an op refused at submission raises ``MXNetArgumentError``, an ``MXNetError``
    as horovod.mxnet's refusals are."""
    try:
        return call(*args, **kwargs)
    except MXNetArgumentError:
        raise
    except RvodInvalidArgumentError as error:
        raise MXNetArgumentError(str(error)) from None


def _wait_for(start, *args, **kwargs):
    return refusing_as_mxnet(_ops.wait_for, start, *args, **kwargs)


def _tensor_list(tensors, what):
    tensors = list(tensors)
    if not tensors:
        raise MXNetArgumentError(f"{what} needs at least one tensor")
    return tensors


# ------------------------------------------------------------------------------------------------ allreduce


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, op=None):
    """Reduce ``tensor`` across ranks (default: Average) into a new NDArray; ``tensor`` is unchanged."""
    return _wait_for(_ops.allreduce_async, adapter_for(tensor), tensor, average, name, op, prescale_factor,
                         postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set, op=None):
    """Reduce ``tensor`` across ranks in place; returns it."""
    return _wait_for(_ops.allreduce_async, adapter_for(tensor), tensor, average, name, op, prescale_factor,
                         postscale_factor, process_set, in_place=True)


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, op=None):
    """Reduce a list of NDArrays as one unit (fused); returns a list of new NDArrays."""
    tensors = _tensor_list(tensors, "grouped_allreduce")
    return _wait_for(_ops.grouped_allreduce_async, adapter_for(tensors), tensors, average, name, op,
                         prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, op=None):
    """Reduce a list of NDArrays in place as one unit; returns the list."""
    tensors = _tensor_list(tensors, "grouped_allreduce_")
    return _wait_for(_ops.grouped_allreduce_async, adapter_for(tensors), tensors, average, name, op,
                         prescale_factor, postscale_factor, process_set, in_place=True)


# ------------------------------------------------------------------------------------------------ allgather


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ)."""
    return _wait_for(_ops.allgather_async, adapter_for(tensor), tensor, name, process_set)


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    """Allgather a list of NDArrays as one unit; returns a list."""
    tensors = _tensor_list(tensors, "grouped_allgather")
    return _wait_for(_ops.grouped_allgather_async, adapter_for(tensors), tensors, name, process_set)


# ------------------------------------------------------------------------------------------------ broadcast


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank as a new NDArray (``root_rank`` is a global rank)."""
    return _wait_for(_ops.broadcast_async, adapter_for(tensor), tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s values; returns it."""
    return _wait_for(_ops.broadcast_async, adapter_for(tensor), tensor, root_rank, name, process_set,
                         in_place=True)


# ---------------------------------------------------------------------------------- alltoall, reducescatter


def _alltoall_splits(splits):
    """``splits`` as a list of ints: integer NDArrays and sequences of integers only (a float split such as
    1.5 would be cut to 1 and send other rows than the caller meant)."""
    if isinstance(splits, mx.nd.NDArray):
        if np.dtype(splits.dtype).kind not in "iu":
            raise MXNetArgumentError("alltoall expects splits to contain integer elements, got an NDArray of "
                                     f"{dtype_name(splits.dtype)}")
        return [int(v) for v in splits.asnumpy().reshape(-1)]
    try:
        values = list(splits)
    except TypeError:
        raise MXNetArgumentError("alltoall expects splits to be an integer NDArray or a list of ints, got "
                                 f"{type(splits).__name__}") from None
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise MXNetArgumentError(f"alltoall expects splits to be integers, got {value!r} "
                                     f"({type(value).__name__})")
    return [int(v) for v in values]


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[i]`` rows of dim 0 to rank i (an even split when None) and gather what the others send.

    ``splits`` is a list of ints or an integer NDArray. Returns the output, or ``(output, received_splits)``
    (an int32 NDArray) when ``splits`` is given. Bad splits, or a first dimension they do not fit, raise
    ``MXNetArgumentError``."""
    split_list = None if splits is None else _alltoall_splits(splits)
    adapter = adapter_for(tensor)
    try:
        handle = _ops.alltoall_async(adapter, tensor, split_list, name, process_set, with_splits=splits is not None)
    except ValueError as error:
        raise MXNetArgumentError(f"alltoall: {error}") from None
    return _synchronize(handle)


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce across ranks, then give rank r its share of dim 0 (the first ranks take the extra rows).
    Only Average and Sum."""
    return _wait_for(_ops.reducescatter_async, adapter_for(tensor), tensor, name, op, process_set,
                         prescale_factor, postscale_factor)


def grouped_reducescatter(tensors, op=Average, name=None, priority=0, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter a list of NDArrays as one unit; returns a list."""
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    return _wait_for(_ops.grouped_reducescatter_async, adapter_for(tensors), tensors, name, op, process_set,
                         prescale_factor, postscale_factor)


# ---------------------------------------------------------------------------------------- join and barrier


def join():
    """Signal that this rank has no more data; blocks until every rank has joined. Meanwhile allreduces
    submitted by the other ranks complete with this rank contributing zeros. Returns the last rank to join."""
    return _ops.join()


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier."""
    _ops.barrier(process_set)
