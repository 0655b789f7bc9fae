"""rvod.torch's collectives as ``torch.library`` custom ops, so that ``torch.compile`` traces them.

While torch.compile traces (``torch.compiler.is_compiling()``), the synchronous ops of ``rvod.torch.mpi_ops``
(allreduce, allreduce_, grouped_allreduce, grouped_allreduce_, allgather, broadcast, broadcast_, alltoall,
reducescatter) call the functions here, which put one op of the ``rvod`` namespace into the graph instead
of running at once. Each op's kernel is the eager op (names, argument checks and errors are the eager
path's); its fake kernel gives the result's shape. allgather, and alltoall with an even split, are traced
for every rank giving as many rows as this one, which their kernel checks (an ``RvodMismatchError`` says
what to do otherwise); where torch.compile captures ops whose output shapes depend on data
(``torch._dynamo.config.capture_dynamic_output_shape_ops``), and for alltoall with splits given, their
first dimension is a size known only when they run (an unbacked size; without that setting, a graph break).

Names: an unnamed op takes its number (``naming``) when the compiled code runs, in the order it runs, as
in eager mode, so ranks running the same compiled code name the same. A name given is passed as it is.

Gradients are eager mode's: each differentiable op's backward is an op of its own (``<op>_backward``)
whose kernel is the eager transpose in ``mpi_ops`` and whose fake kernel gives the input's shape.
Differentiating twice through them is not supported. The ``*_async`` forms and the grouped allgather and
reducescatter are not ops here: inside a compiled function they break the graph and run eagerly.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op, get_ctx

from rvod.common import ops as _ops
from rvod.common.process_sets import process_set_id_of, registered_process_set
from rvod.common.reduce_ops import Average, resolve_op
from rvod.exceptions import RvodMismatchError
from rvod.torch import mpi_ops

# ------------------------------------------------------------------------------------------------- helpers


def _set_id(process_set):
    """The set's id as the graph carries it; an unregistered set raises as in eager mode (a graph break)."""
    set_id = process_set.process_set_id
    return process_set_id_of(process_set) if set_id is None else set_id


def _process_set(set_id):
    found = registered_process_set(set_id)
    if found is None:
        raise ValueError(f"process set {set_id} is not registered on this rank (removed after compiling?)")
    return found


def _fresh(result, tensor):
    """A custom op's output may not alias its input: copy the rare result that is the input."""
    return result.clone() if result is tensor else result


def _unknown_rows(like, expected_rows):
    """A tensor shaped like ``like`` but for its first dimension: ``expected_rows``, or when that is -1 a
    size the op decides when it runs (an unbacked size)."""
    rows = get_ctx().new_dynamic_size() if expected_rows == _UNKNOWN else expected_rows
    return like.new_empty((rows, *like.shape[1:]))


def _expected_rows(rows):
    """What a traced allgather or alltoall takes its first dimension to be: ``rows``, or unknown (-1) when
    torch.compile captures ops whose output shapes depend on data (then they stay in the graph too)."""
    return _UNKNOWN if torch._dynamo.config.capture_dynamic_output_shape_ops else rows


def _check_rows(result, expected_rows, what, name):
    """Raise when ``result`` lacks the first dimension the graph was traced for (on every rank whose result
    differs: for allgather, every rank)."""
    if expected_rows != _UNKNOWN and result.shape[0] != expected_rows:
        raise RvodMismatchError(
            f"{what} {name or '(unnamed)'}: under torch.compile its output shape is fixed when tracing, for "
            f"{expected_rows} rows (every rank giving as many rows as this one), but it got {result.shape[0]}; "
            f"{what} tensors of different first dimensions outside the compiled function, pad them to the same "
            "size, or set torch._dynamo.config.capture_dynamic_output_shape_ops = True")
    return result


_UNKNOWN = -1


def _rows_like(grad, rows):
    return grad.new_empty((rows, *grad.shape[1:]))


# ------------------------------------------------------------------------------------------------ allreduce


@custom_op("rvod::allreduce", mutates_args=())
def _allreduce(tensor: Tensor, name: Optional[str], op: int, prescale_factor: float, postscale_factor: float,
               process_set_id: int) -> Tensor:
    return _fresh(mpi_ops.allreduce(tensor, name=name, op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=_process_set(process_set_id)),
                  tensor)


@_allreduce.register_fake
def _(tensor, name, op, prescale_factor, postscale_factor, process_set_id):
    return torch.empty_like(tensor)


@custom_op("rvod::allreduce_backward", mutates_args=())
def _allreduce_backward(grad: Tensor, op: int, prescale_factor: float, postscale_factor: float,
                        process_set_id: int) -> Tensor:
    return _fresh(mpi_ops._allreduce_grad(grad, op, (prescale_factor, postscale_factor),
                                          _process_set(process_set_id)), grad)


@_allreduce_backward.register_fake
def _(grad, op, prescale_factor, postscale_factor, process_set_id):
    return torch.empty_like(grad)


def _allreduce_setup(ctx, inputs, output):
    ctx.args = inputs[2:]


def _allreduce_grad(ctx, grad):
    return _allreduce_backward(grad, *ctx.args), None, None, None, None, None


_allreduce.register_autograd(_allreduce_grad, setup_context=_allreduce_setup)


@custom_op("rvod::allreduce_", mutates_args=("tensor",))
def _allreduce_inplace(tensor: Tensor, name: Optional[str], op: int, prescale_factor: float,
                       postscale_factor: float, process_set_id: int) -> None:
    mpi_ops.allreduce_(tensor, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                       process_set=_process_set(process_set_id))


@_allreduce_inplace.register_fake
def _(tensor, name, op, prescale_factor, postscale_factor, process_set_id):
    return None


@custom_op("rvod::grouped_allreduce", mutates_args=())
def _grouped_allreduce(tensors: List[Tensor], name: Optional[str], op: int, prescale_factor: float,
                       postscale_factor: float, process_set_id: int) -> List[Tensor]:
    reduced = mpi_ops.grouped_allreduce(tensors, name=name, op=op, prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor, process_set=_process_set(process_set_id))
    return [_fresh(r, t) for r, t in zip(reduced, tensors)]


@_grouped_allreduce.register_fake
def _(tensors, name, op, prescale_factor, postscale_factor, process_set_id):
    return [torch.empty_like(t) for t in tensors]


@custom_op("rvod::grouped_allreduce_backward", mutates_args=())
def _grouped_allreduce_backward(grads: List[Tensor], op: int, prescale_factor: float, postscale_factor: float,
                                process_set_id: int) -> List[Tensor]:
    reduced = mpi_ops._grouped_allreduce_grad(grads, op, (prescale_factor, postscale_factor),
                                              _process_set(process_set_id))
    return [_fresh(r, g) for r, g in zip(reduced, grads)]


@_grouped_allreduce_backward.register_fake
def _(grads, op, prescale_factor, postscale_factor, process_set_id):
    return [torch.empty_like(g) for g in grads]


def _grouped_allreduce_grad(ctx, grads):
    return _grouped_allreduce_backward(list(grads), *ctx.args), None, None, None, None, None


_grouped_allreduce.register_autograd(_grouped_allreduce_grad, setup_context=_allreduce_setup)


@custom_op("rvod::grouped_allreduce_", mutates_args=("tensors",))
def _grouped_allreduce_inplace(tensors: List[Tensor], name: Optional[str], op: int, prescale_factor: float,
                               postscale_factor: float, process_set_id: int) -> None:
    mpi_ops.grouped_allreduce_(tensors, name=name, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=_process_set(process_set_id))


@_grouped_allreduce_inplace.register_fake
def _(tensors, name, op, prescale_factor, postscale_factor, process_set_id):
    return None


def allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    return _allreduce(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor, _set_id(process_set))


def allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    _allreduce_inplace(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                       _set_id(process_set))
    return tensor


def grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set):
    return _grouped_allreduce(tensors, name, resolve_op(op, average), prescale_factor, postscale_factor,
                              _set_id(process_set))


def grouped_allreduce_(tensors, average, name, op, prescale_factor, postscale_factor, process_set):
    _grouped_allreduce_inplace(tensors, name, resolve_op(op, average), prescale_factor, postscale_factor,
                               _set_id(process_set))
    return tensors


# ------------------------------------------------------------------------------------------------ allgather


@custom_op("rvod::allgather", mutates_args=())
def _allgather(tensor: Tensor, name: Optional[str], expected_rows: int, process_set_id: int) -> Tensor:
    gathered = mpi_ops.allgather(tensor, name=name, process_set=_process_set(process_set_id))
    return _fresh(_check_rows(gathered, expected_rows, "allgather", name), tensor)


@_allgather.register_fake
def _(tensor, name, expected_rows, process_set_id):
    return _unknown_rows(tensor, expected_rows)


@custom_op("rvod::allgather_backward", mutates_args=())
def _allgather_backward(grad: Tensor, rows: int, process_set_id: int) -> Tensor:
    return _fresh(mpi_ops._allgather_grad(grad, rows, _process_set(process_set_id)), grad)


@_allgather_backward.register_fake
def _(grad, rows, process_set_id):
    return _rows_like(grad, rows)


def _allgather_setup(ctx, inputs, output):
    tensor, _, _, ctx.process_set_id = inputs
    ctx.rows = tensor.shape[0] if tensor.dim() else 0


def _allgather_grad(ctx, grad):
    return _allgather_backward(grad, ctx.rows, ctx.process_set_id), None, None, None


_allgather.register_autograd(_allgather_grad, setup_context=_allgather_setup)


def allgather(tensor, name, process_set):
    """Traced for every rank giving as many rows as this one (see ``_expected_rows``)."""
    set_id = _set_id(process_set)
    rows = (tensor.shape[0] if tensor.dim() else 1) * _process_set(set_id).size()
    return _allgather(tensor, name, _expected_rows(rows), set_id)


# ------------------------------------------------------------------------------------------------ broadcast


@custom_op("rvod::broadcast", mutates_args=())
def _broadcast(tensor: Tensor, root_rank: int, name: Optional[str], process_set_id: int) -> Tensor:
    return _fresh(mpi_ops.broadcast(tensor, root_rank, name=name, process_set=_process_set(process_set_id)), tensor)


@_broadcast.register_fake
def _(tensor, root_rank, name, process_set_id):
    return torch.empty_like(tensor)


@custom_op("rvod::broadcast_backward", mutates_args=())
def _broadcast_backward(grad: Tensor, root_rank: int, process_set_id: int) -> Tensor:
    return _fresh(mpi_ops._broadcast_grad(grad, root_rank, _process_set(process_set_id)), grad)


@_broadcast_backward.register_fake
def _(grad, root_rank, process_set_id):
    return torch.empty_like(grad)


def _broadcast_setup(ctx, inputs, output):
    _, ctx.root_rank, _, ctx.process_set_id = inputs


def _broadcast_grad(ctx, grad):
    return _broadcast_backward(grad, ctx.root_rank, ctx.process_set_id), None, None, None


_broadcast.register_autograd(_broadcast_grad, setup_context=_broadcast_setup)


@custom_op("rvod::broadcast_", mutates_args=("tensor",))
def _broadcast_inplace(tensor: Tensor, root_rank: int, name: Optional[str], process_set_id: int) -> None:
    mpi_ops.broadcast_(tensor, root_rank, name=name, process_set=_process_set(process_set_id))


@_broadcast_inplace.register_fake
def _(tensor, root_rank, name, process_set_id):
    return None


def broadcast(tensor, root_rank, name, process_set):
    return _broadcast(tensor, root_rank, name, _set_id(process_set))


def broadcast_(tensor, root_rank, name, process_set):
    _broadcast_inplace(tensor, root_rank, name, _set_id(process_set))
    return tensor


# ------------------------------------------------------------------------------------------------- alltoall


@custom_op("rvod::alltoall", mutates_args=())
def _alltoall(tensor: Tensor, splits: Optional[Tensor], split_list: Optional[List[int]], name: Optional[str],
              expected_rows: int, process_set_id: int) -> Tuple[Tensor, Tensor]:
    given = splits if splits is not None else split_list
    output, received = _ops.wait_for(mpi_ops.alltoall_async, tensor, given, name, _process_set(process_set_id))
    return _fresh(_check_rows(output, expected_rows, "alltoall", name), tensor), received


@_alltoall.register_fake
def _(tensor, splits, split_list, name, expected_rows, process_set_id):
    received = tensor.new_empty((_process_set(process_set_id).size(),), dtype=torch.int32)
    return _unknown_rows(tensor, expected_rows), received


@custom_op("rvod::alltoall_backward", mutates_args=())
def _alltoall_backward(grad: Tensor, received_splits: Tensor, rows: int, process_set_id: int) -> Tensor:
    return _fresh(mpi_ops._alltoall_grad(grad, received_splits, _process_set(process_set_id)), grad)


@_alltoall_backward.register_fake
def _(grad, received_splits, rows, process_set_id):
    return _rows_like(grad, rows)


def _alltoall_setup(ctx, inputs, output):
    tensor, _, _, _, _, ctx.process_set_id = inputs
    ctx.rows = tensor.shape[0] if tensor.dim() else 0
    ctx.save_for_backward(output[1])


def _alltoall_grad(ctx, grad, grad_received_splits):
    (received_splits,) = ctx.saved_tensors
    return _alltoall_backward(grad, received_splits, ctx.rows, ctx.process_set_id), None, None, None, None, None


_alltoall.register_autograd(_alltoall_grad, setup_context=_alltoall_setup)


def alltoall(tensor, splits, name, process_set):
    """``(output, received_splits)``; ``splits`` a list of ints, an int32 tensor, or None (an even split,
    traced for every rank giving as many rows as this one; with splits given, the rows received are known
    only when it runs)."""
    rows = _expected_rows(tensor.shape[0]) if splits is None else _UNKNOWN
    if isinstance(splits, Tensor):
        return _alltoall(tensor, splits, None, name, rows, _set_id(process_set))
    return _alltoall(tensor, None, None if splits is None else list(splits), name, rows, _set_id(process_set))


# -------------------------------------------------------------------------------------------- reducescatter


@custom_op("rvod::reducescatter", mutates_args=())
def _reducescatter(tensor: Tensor, name: Optional[str], op: int, process_set_id: int, prescale_factor: float,
                   postscale_factor: float) -> Tensor:
    return _fresh(mpi_ops.reducescatter(tensor, name=name, op=op, process_set=_process_set(process_set_id),
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor), tensor)


@_reducescatter.register_fake
def _(tensor, name, op, process_set_id, prescale_factor, postscale_factor):
    process_set = _process_set(process_set_id)
    count, me = process_set.size(), process_set.rank()
    # sharding.chunk's share, in arithmetic that a symbolic (or unbacked) first dimension goes through.
    return _rows_like(tensor, (tensor.shape[0] + count - 1 - me) // count)


@custom_op("rvod::reducescatter_backward", mutates_args=())
def _reducescatter_backward(grad: Tensor, op: int, prescale_factor: float, postscale_factor: float,
                            process_set_id: int, rows: int) -> Tensor:
    return _fresh(mpi_ops._reducescatter_transpose(grad, op, (prescale_factor, postscale_factor),
                                                   _process_set(process_set_id)), grad)


@_reducescatter_backward.register_fake
def _(grad, op, prescale_factor, postscale_factor, process_set_id, rows):
    return _rows_like(grad, rows)


def _reducescatter_setup(ctx, inputs, output):
    tensor, _, op, ctx.process_set_id, prescale_factor, postscale_factor = inputs
    ctx.args = (op, prescale_factor, postscale_factor)
    ctx.rows = tensor.shape[0]


def _reducescatter_grad(ctx, grad):
    return (_reducescatter_backward(grad, *ctx.args, ctx.process_set_id, ctx.rows),
            None, None, None, None, None)


_reducescatter.register_autograd(_reducescatter_grad, setup_context=_reducescatter_setup)


def reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor):
    return _reducescatter(tensor, name, resolve_op(op, None, Average), _set_id(process_set), prescale_factor,
                          postscale_factor)
