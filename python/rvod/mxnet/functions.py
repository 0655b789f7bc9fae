"""Making every rank start from the same state: parameters (including deferred-initialized Gluon
parameters) and arbitrary picklable objects."""

import types

import mxnet as mx

from rvod.common import objects as _objects
from rvod.common import ops as _ops
from rvod.common.process_sets import global_process_set
from rvod.mxnet.adapter import adapter_for
from rvod.mxnet.mpi_ops import refusing_as_mxnet, size

__all__ = ["allgather_object", "broadcast_object", "broadcast_parameters"]


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s object (any picklable object, of any size) on every rank of ``process_set``."""
    return refusing_as_mxnet(_objects.broadcast_object, obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """A list with the object of every rank of ``process_set`` (picklable, of any size), in rank order."""
    return refusing_as_mxnet(_objects.allgather_object, obj, name, process_set)


def _broadcast_arrays(named_arrays, root_rank):
    """Overwrite NDArrays with ``root_rank``'s values: ``named_arrays`` is a list of (name, copies), the
    copies being one parameter's arrays on each of its contexts. The first copy of each is broadcast (all
    at once, so the engine fuses them), then copied to the others."""
    handles = [_ops.broadcast_async(adapter_for(copies[0]), copies[0], root_rank, name, in_place=True)
               for name, copies in named_arrays]
    for handle in handles:
        _ops.synchronize(handle)
    for _, copies in named_arrays:
        for other in copies[1:]:
            copies[0].copyto(other)


def _broadcast_after_init(param, root_rank, name):
    """Make ``param`` broadcast its value from ``root_rank`` as soon as its deferred initialization runs
    (when its shape becomes known, in the first forward pass). Calling this again replaces the earlier
    hook instead of adding a second one."""
    init_impl = getattr(param, "_rvod_init_impl", param._init_impl)
    param._rvod_init_impl = init_impl

    def init_then_broadcast(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        _broadcast_arrays([(name, self.list_data())], root_rank)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params, root_rank=0, prefix=None):
    """Overwrite parameters in place with ``root_rank``'s values.

    ``params`` is a dict of NDArrays (``Module.get_params()``'s, to pass back with ``set_params``) or of
    Gluon ``Parameter`` s, or a ``ParameterDict`` (``Block.collect_params()``). Broadcasts are named
    ``prefix`` + key (pass a different ``prefix`` to each call that broadcasts other parameters under the
    same keys) and run in key order. A Gluon parameter whose initialization is deferred is broadcast
    right after it is initialized. Does nothing in a job of one rank.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None, got {type(prefix).__name__}")
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError(f"invalid params of type: {type(params)}")
    if size() == 1:
        return
    prefix = prefix or ""
    named_arrays = []
    for key, value in sorted(params.items()):
        name = prefix + str(key)
        if isinstance(value, mx.gluon.Parameter):
            try:
                named_arrays.append((name, value.list_data()))
            except mx.gluon.DeferredInitializationError:
                _broadcast_after_init(value, root_rank, name)
        elif isinstance(value, mx.nd.NDArray):
            named_arrays.append((name, [value]))
        else:
            raise ValueError(f"invalid params: {key!r} is a {type(value).__name__}, not an NDArray or a Parameter")
    _broadcast_arrays(named_arrays, root_rank)
