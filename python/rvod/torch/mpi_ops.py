"""Horovod's collective ops on torch tensors, and the autograd functions behind the out-of-place ones.

Names, argument orders and defaults are ``horovod.torch``'s. Out-of-place synchronous ops are
differentiable with the gradients Horovod defines:

- allreduce: the gradient is allreduced with the same op and scale factors;
- allgather: the gradient is averaged across ranks and each rank keeps the rows of its own input;
- broadcast: the gradient is averaged across ranks on the root and zero elsewhere;
- alltoall: the gradient travels back along the received splits;
- reducescatter: the gradients are allgathered (times the set size for Sum) and scaled like the input.

``*_`` ops write their result into the input, ``*_async*`` ops return a handle for ``poll`` and
``synchronize``. Waiting releases the GIL. Under ``torch.compile`` (PyTorch 2.4 and later) the synchronous
ops put custom ops into the graph instead (``rvod.torch.compiled_ops``), which run these ones with these
gradients; with an older PyTorch they break the graph and run eagerly.
"""

import torch

from rvod.common import naming
from rvod.common import ops as _ops
from rvod.common.basics import *  # noqa: F401,F403  (the basics, re-exported by rvod.torch)
from rvod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    process_set_id_of,
    remove_process_set,
)
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum, resolve_op  # noqa: F401
from rvod.exceptions import RvodInvalidArgumentError
from rvod.torch.adapter import TorchAdapter
from rvod.torch.compression import Compression
from rvod.common.compression import engine_code

_adapter = TorchAdapter()
# torch.compile traces the synchronous ops as custom ops (``compiled_ops``) from PyTorch 2.4, which has
# ``torch.library.custom_op``. With an older PyTorch there are none: a compiled function breaks its graph at
# an rvod op, which runs eagerly, and the ops never take the compiled path.
TRACES_CUSTOM_OPS = hasattr(torch.library, "custom_op")
# Whether the synchronous ops go through ``compiled_ops``: while torch.compile traces, which it takes as the
# constant True; eagerly it costs a global read.
_compiling = torch.compiler.is_compiling if TRACES_CUSTOM_OPS else lambda: False
poll = _ops.poll
synchronize = _ops.synchronize


def _check_has_gpu():
    """Whether rvod runs collectives on GPU tensors here: not in this version, whatever NCCL and CUDA it
    finds (``rvodrun --check-build`` says what it found; README, "GPU status")."""
    return False


# ------------------------------------------------------------------------------------------------ allreduce


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``tensor`` across ranks into a new tensor; returns a handle."""
    return _ops.allreduce_async(_adapter, tensor, average, name, op, prescale_factor, postscale_factor,
                                process_set)


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the output gradient with the same op and factors."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set, compression=0):
        ctx.op = resolve_op(op, average)
        ctx.factors = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        ctx.compression = compression
        return _ops.allreduce(_adapter, tensor, None, name, ctx.op, prescale_factor, postscale_factor, process_set,
                              compression=compression)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _allreduce_grad(grad_output, ctx.op, ctx.factors, ctx.process_set, ctx.compression)
        return (grad,) + (None,) * 7


def _allreduce_grad(grad, op, factors, process_set, compression=0):
    """allreduce's transpose: the same allreduce of the output's gradient (compressed alike, not twice
    differentiable then)."""
    if compression:
        return _ops.allreduce(_adapter, grad, None, None, op, factors[0], factors[1], process_set,
                              compression=compression)
    return allreduce(grad, op=op, prescale_factor=factors[0], postscale_factor=factors[1], process_set=process_set)


def _engine_code(compression, tensors):
    """The engine's compression code for ``tensors`` (see ``rvod.common.compression``); torch.compile does
    not trace compressed allreduces."""
    code = engine_code(compression, tensors)
    if code and _compiling():
        raise RvodInvalidArgumentError(f"{compression!r}: a compressed allreduce cannot run inside torch.compile; "
                                       "call it outside the compiled function (DistributedOptimizer does)")
    return code


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default: Average) into a new tensor; differentiable."""
    compressed, context = compression.compress(tensor)
    code = _engine_code(compression, [compressed])
    if code:
        if compressed.requires_grad and torch.is_grad_enabled():
            return HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                                          process_set, code)
        return _ops.allreduce(_adapter, compressed, average, name, op, prescale_factor, postscale_factor,
                              process_set, compression=code)
    if _compiling():
        reduced = _compiled.allreduce(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    elif compressed.requires_grad and torch.is_grad_enabled():
        reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                                         process_set)
    else:  # nothing to differentiate: skip autograd's bookkeeping (a few microseconds per call)
        reduced = _ops.allreduce(_adapter, compressed, average, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return compression.decompress(reduced, context)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start reducing ``tensor`` in place; returns a handle."""
    return _ops.allreduce_async(_adapter, tensor, average, name, op, prescale_factor, postscale_factor,
                                process_set, True)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` across ranks in place; returns it."""
    if _compiling():
        return _compiled.allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _ops.allreduce(_adapter, tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """Start reducing a list of tensors as one unit; the handle's result is a list of new tensors."""
    return _ops.grouped_allreduce_async(_adapter, tensors, average, name, op, prescale_factor, postscale_factor,
                                        process_set)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; the gradients are grouped-allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, compression, *tensors):
        ctx.op = resolve_op(op, average)
        ctx.factors = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        ctx.compression = compression
        return tuple(_ops.wait_for(_ops.grouped_allreduce_async, _adapter, list(tensors), None, name, ctx.op,
                                   prescale_factor, postscale_factor, process_set, False, compression))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = _grouped_allreduce_grad(list(grad_outputs), ctx.op, ctx.factors, ctx.process_set, ctx.compression)
        return (None,) * 7 + tuple(grads)


def _grouped_allreduce_grad(grads, op, factors, process_set, compression=0):
    """grouped_allreduce's transpose: the same grouped allreduce of the outputs' gradients."""
    if compression:
        return _ops.wait_for(_ops.grouped_allreduce_async, _adapter, grads, None, None, op, factors[0], factors[1],
                             process_set, False, compression)
    return grouped_allreduce(grads, op=op, prescale_factor=factors[0], postscale_factor=factors[1],
                             process_set=process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors as one unit (they are fused together); returns a list; differentiable."""
    tensors = list(tensors)
    if not tensors:
        raise RvodInvalidArgumentError("grouped_allreduce needs at least one tensor")
    compressed = [compression.compress(t) for t in tensors]
    code = _engine_code(compression, [c for c, _ in compressed])
    if _compiling() and not code:
        reduced = _compiled.grouped_allreduce([c for c, _ in compressed], average, name, op, prescale_factor,
                                              postscale_factor, process_set)
    else:
        reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                                code, *[c for c, _ in compressed])
    return [compression.decompress(r, context) for r, (_, context) in zip(reduced, compressed)]


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Start reducing a list of tensors in place as one unit; returns a handle."""
    return _ops.grouped_allreduce_async(_adapter, tensors, average, name, op, prescale_factor, postscale_factor,
                                        process_set, in_place=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce a list of tensors in place as one unit; returns the list."""
    if _compiling():
        return _compiled.grouped_allreduce_(list(tensors), average, name, op, prescale_factor, postscale_factor,
                                            process_set)
    return _ops.wait_for(grouped_allreduce_async_, tensors, average, name, op, prescale_factor, postscale_factor,
                         process_set)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Returns a function; calling it waits and returns the reduced sparse tensor (not coalesced: duplicate
    indices add up when it is coalesced). Only Sum and Average can be reduced this way.
    """
    op = resolve_op(op, None)
    if op not in (Sum, Average):
        raise RvodInvalidArgumentError("sparse_allreduce_async supports only Sum and Average")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise RvodInvalidArgumentError("sparse_allreduce_async expects a sparse COO tensor")
    base = naming.next_name("sparse_allreduce", process_set_id_of(process_set)) if name is None else name
    try:
        indices_handle = allgather_async(tensor._indices().t(), f"{base}.indices", process_set)
    except (TypeError, ValueError):
        if name is None:  # refused before anything was sent: the name goes back
            naming.give_back([base], process_set_id_of(process_set))
        raise
    values_handle = allgather_async(tensor._values(), f"{base}.values", process_set)

    def wait():
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == Average:
            values = values / process_set.size()
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape, check_invariants=False)

    return wait


# ------------------------------------------------------------------------------------------------ allgather


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along dim 0; returns a handle."""
    return _ops.allgather_async(_adapter, tensor, name, process_set)


def _own_rows(grad, own_counts, process_set):
    """The rows of ``grad`` (rows of every rank, in rank order) that belong to this rank's inputs.

    ``own_counts`` are this rank's first dimensions, one per tensor; returns one slice per tensor."""
    counts = allgather(torch.tensor([own_counts], dtype=torch.int64), process_set=process_set)
    offsets = counts[:process_set.rank()].sum(dim=0).tolist()
    return [g.narrow(0, offset, count) for g, offset, count in zip(grad, offsets, own_counts)]


class HorovodAllgather(torch.autograd.Function):
    """Allgather; the gradient is averaged across ranks, and each rank keeps its own rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 0
        ctx.process_set = process_set
        return _ops.allgather(_adapter, tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        return _allgather_grad(grad_output, ctx.rows, ctx.process_set), None, None


def _allgather_grad(grad, rows, process_set):
    """allgather's transpose: the gradient averaged across ranks, this rank's ``rows`` of it."""
    reduced = allreduce(grad, op=Average, process_set=process_set)
    return _own_rows([reduced], [rows], process_set)[0]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ); differentiable."""
    if _compiling():
        return _compiled.allgather(tensor, name, process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodAllgather.apply(tensor, name, process_set)
    return _ops.allgather(_adapter, tensor, name, process_set)  # nothing to differentiate, as allreduce


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start allgathering a list of tensors as one unit; returns a handle."""
    return _ops.grouped_allgather_async(_adapter, tensors, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather with allgather's gradient for each tensor."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(_ops.wait_for(grouped_allgather_async, list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grad_outputs):
        reduced = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        return (None, None) + tuple(_own_rows(reduced, ctx.rows, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list of tensors as one unit; returns a list; differentiable."""
    tensors = list(tensors)
    if not tensors:
        raise RvodInvalidArgumentError("grouped_allgather needs at least one tensor")
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ------------------------------------------------------------------------------------------------ broadcast


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying ``root_rank``'s ``tensor`` into a new tensor on every rank; returns a handle."""
    return _ops.broadcast_async(_adapter, tensor, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; the gradient is averaged across ranks on the root and zero on the other ranks."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return _ops.broadcast(_adapter, tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        return _broadcast_grad(grad_output, ctx.root_rank, ctx.process_set), None, None, None


def _broadcast_grad(grad, root_rank, process_set):
    """broadcast's transpose: the gradient averaged across ranks on the root, zero elsewhere."""
    grad = allreduce(grad, op=Average, process_set=process_set)
    return grad if rank() == root_rank else torch.zeros_like(grad)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (``root_rank`` is a global rank); differentiable."""
    if _compiling():
        return _compiled.broadcast(tensor, root_rank, name, process_set)
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    return _ops.broadcast(_adapter, tensor, root_rank, name, process_set)  # nothing to differentiate


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` with ``root_rank``'s values; returns a handle."""
    return _ops.broadcast_async(_adapter, tensor, root_rank, name, process_set, in_place=True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s values; returns it."""
    if _compiling():
        return _compiled.broadcast_(tensor, root_rank, name, process_set)
    return _ops.broadcast(_adapter, tensor, root_rank, name, process_set, True)


# ------------------------------------------------------------------------------------------------- alltoall


def _alltoall_splits(tensor, splits, process_set):
    """The rows to send to each rank, as a list: ``splits`` checked as Horovod does, or an even split."""
    if splits is None:
        process_set_id_of(process_set)  # an unusable set is refused here, before its size is needed
        count = process_set.size()
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
        if rows % count:
            raise RvodInvalidArgumentError("splits not provided, but first dimension of tensor is not an even multiple of the "
                             "number of workers.")
        return [rows // count] * count
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise RvodInvalidArgumentError("alltoall expects splits to contain 32-bit integer elements.")
        if splits.device.type != "cpu":
            raise RvodInvalidArgumentError("alltoall expects splits to be a CPU tensor.")
    return _adapter.to_int_list(splits)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[i]`` rows of dim 0 to rank i (an even split when None) and gathering what the
    others send; the handle's result is ``(output, received_splits)``."""
    return _ops.alltoall_async(_adapter, tensor, _alltoall_splits(tensor, splits, process_set), name, process_set)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; the gradient goes back to where each row came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = _ops.wait_for(alltoall_async, tensor, splits, name, process_set)
        ctx.received_splits = received_splits
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, grad_received_splits):
        return _alltoall_grad(grad_output, ctx.received_splits, ctx.process_set), None, None, None


def _alltoall_grad(grad, received_splits, process_set):
    """alltoall's transpose: each row of the gradient goes back to the rank it came from."""
    return alltoall(grad, splits=received_splits, process_set=process_set)[0]


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter slices of dim 0 to the ranks and gather what they send; differentiable.

    Returns the output, or ``(output, received_splits)`` when ``splits`` is given."""
    if _compiling():
        output, received_splits = _compiled.alltoall(tensor, splits, name, process_set)
    else:
        output, received_splits = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received_splits)


# -------------------------------------------------------------------------------------------- reducescatter


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0, output=None):
    """Start reducing ``tensor`` and giving each rank its share of dim 0; returns a handle. rvod's own
    ``output=``: a contiguous CPU tensor of ``tensor``'s dtype with this rank's share's number of elements
    (any shape), which the result is written into (``synchronize`` returns it) instead of a new tensor."""
    return _ops.reducescatter_async(_adapter, tensor, name, op, process_set, prescale_factor, postscale_factor,
                                    output)


def _reducescatter_grad(gathered, op, factors, process_set):
    scale = factors[0] * factors[1] * (process_set.size() if op == Sum else 1)
    return gathered if scale == 1 else gathered * scale


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; the gradients are allgathered (times the set size for Sum) and scaled like the input."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op = resolve_op(op, None)
        ctx.factors = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return _ops.wait_for(reducescatter_async, tensor, name, ctx.op, process_set, prescale_factor,
                             postscale_factor)

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_transpose(grad_output, ctx.op, ctx.factors, ctx.process_set), None, None, None, None, None


def _reducescatter_transpose(grad, op, factors, process_set):
    """reducescatter's transpose: the gradients of every rank's share, allgathered and scaled."""
    return _reducescatter_grad(allgather(grad, process_set=process_set), op, factors, process_set)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce across ranks, then give rank r its share of dim 0 (the first ranks take the extra rows);
    differentiable. Only Average and Sum."""
    compressed, context = compression.compress(tensor)
    if _compiling():
        reduced = _compiled.reducescatter(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        reduced = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, context)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start reducescattering a list of tensors as one unit; returns a handle."""
    return _ops.grouped_reducescatter_async(_adapter, tensors, name, op, process_set, prescale_factor,
                                            postscale_factor)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter with reducescatter's gradient for each tensor."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op = resolve_op(op, None)
        ctx.factors = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return tuple(_ops.wait_for(grouped_reducescatter_async, list(tensors), name, ctx.op, process_set,
                                   prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, *grad_outputs):
        gathered = grouped_allgather(list(grad_outputs), process_set=ctx.process_set)
        return (None,) * 5 + tuple(_reducescatter_grad(g, ctx.op, ctx.factors, ctx.process_set) for g in gathered)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter a list of tensors as one unit; returns a list; differentiable."""
    tensors = list(tensors)
    if not tensors:
        raise RvodInvalidArgumentError("grouped_reducescatter needs at least one tensor")
    compressed = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                                *[c for c, _ in compressed])
    return [compression.decompress(r, context) for r, (_, context) in zip(reduced, compressed)]


# ---------------------------------------------------------------------------------------- join and barrier


def join(device=-1):
    """Signal that this rank has no more data; blocks until every rank has joined. Meanwhile allreduces
    submitted by the other ranks complete with this rank contributing zeros. Returns the last rank to join.

    ``device`` is where Horovod puts those zeros. This build keeps them on the CPU whatever the device, as
    Horovod does in a job without GPUs (scripts commonly pass ``hvd.local_rank()``)."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join(device=...) takes a device id (an int), got {type(device).__name__}")
    return _ops.join()


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier."""
    _ops.barrier(process_set)


if TRACES_CUSTOM_OPS:
    from rvod.torch import compiled_ops as _compiled  # noqa: E402  (its ops run the ones above)
