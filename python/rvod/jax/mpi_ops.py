"""Horovod's collective ops on jax.Arrays, eagerly and inside ``jax.jit``, with Horovod's gradients.

Eagerly (concrete arrays, no trace active) an op runs at once through ``rvod.common.ops``, the arrays
crossing by DLPack (``rvod.jax.adapter``). While tracing (``jax.jit``, ``lax.scan``, ``jax.grad``...) an op
becomes an ordered host callback, ``jax.experimental.io_callback(..., ordered=True)``, which runs that same
eager op when the compiled program reaches it. Why a callback rather than an XLA FFI custom call: an FFI
target is compiled C++ registered with one jaxlib's ABI, while the callback needs no compilation (one rvod
wheel serves every JAX version, as DLPack lets it serve every PyTorch and TensorFlow); and an *ordered*
effect is what keeps ranks from deadlocking: XLA may reorder or run concurrently computations that do not
depend on each other, and two ranks that started two collectives in different orders would each wait for
the other's first. Ordered effects are threaded through a token, so every rank runs its collectives in
program order, one at a time, across ``jit`` calls, ``lax.scan`` iterations and ``jax.grad``'s backward
pass. The cost is a host round trip per op, nothing next to the exchange on a CPU. (Ordered callbacks
cannot be ``jax.vmap``ped or ``pmap``ped; rvod.jax is for one process per rank.)

Names. Eager ops are named as in every shim (the user's name, or ``noname.<n>`` in call order). A traced op
is named when traced, ``traced.<name>``, or for an unnamed one ``traced.<file>:<line>`` of the user's call:
the same on every rank that runs the same program, the same at every call of the compiled function (so the
engine's response cache serves it), and independent of how often or on which ranks a function is traced
(a rank that retraces alone, or inspects ``jax.make_jaxpr`` on rank 0, moves no name). Two traced ops may
share a name (a Python loop at one line): they run one after the other, never at the same time. rvod.jax
never communicates while tracing.

Shapes inside jit are fixed when tracing, so ``allgather`` there needs the same first dimension on every
rank (checked when it runs: every rank raises, naming the first dimensions), and ``alltoall`` takes no
``splits`` (an even split; the output has the input's shape). Eagerly both take uneven first dimensions
and splits, as in Horovod. Errors inside a compiled function reach the caller as jax's ``JaxRuntimeError``,
whose message carries rvod's (its class, the op and the tensor's name).

Gradients (``jax.custom_vjp``) are Horovod's, as ``rvod.torch`` defines them:

- allreduce: the cotangent is allreduced with the same op and scale factors;
- allgather: the cotangent is averaged across ranks and each rank keeps the rows of its own input;
- broadcast: the cotangent is averaged across ranks on the root and zero elsewhere;
- alltoall: the cotangent travels back along the received splits;
- reducescatter: the cotangents are allgathered (times the set size for Sum) and scaled like the input.

There are no in-place ops (jax.Arrays are immutable) and no ``*_async`` ops (JAX dispatches asynchronously
itself). ``grouped_*`` ops take any pytree of arrays and return the same structure.
"""

import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from rvod.common import ops as _ops
from rvod.common.basics import *  # noqa: F401,F403  (the basics, re-exported by rvod.jax)
from rvod.common.basics import rank
from rvod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    process_set_id_of,
    remove_process_set,
)
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum, resolve_op  # noqa: F401
from rvod.common.sharding import chunk
from rvod.exceptions import RvodInvalidArgumentError, RvodMismatchError
from rvod.jax.adapter import HostResultsAdapter, JaxAdapter, as_array

_adapter = JaxAdapter()
_host_results = HostResultsAdapter()
_Tracer = jax.core.Tracer


def _find_trace_state_clean():
    """JAX's "no trace is active" test (public in older versions, private in newer ones)."""
    for module in ("jax.core", "jax._src.core"):
        try:
            found = getattr(importlib.import_module(module), "trace_state_clean", None)
        except ImportError:
            found = None
        if found is not None:
            return found
    raise ImportError(f"rvod.jax cannot tell whether JAX {jax.__version__} is tracing (no trace_state_clean)")


_trace_state_clean = _find_trace_state_clean()


def _staged(values):
    """Whether an op on ``values`` is being traced (and must run as a callback of the compiled program)."""
    return any(isinstance(v, _Tracer) for v in values) or not _trace_state_clean()


# Packages whose frames are skipped when naming a traced op by the user's call site.
_OWN_PACKAGES = frozenset({"rvod", "jax", "jaxlib", "optax"})


def _call_site():
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _OWN_PACKAGES:
        frame = frame.f_back
    if frame is None:
        return "unknown"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _name(name, staged):
    """The name ranks match an op by (see the module doc); None: the engine's call-order counter."""
    if not staged:
        return name
    return f"traced.{name if name is not None else _call_site()}"


def _grad_name(name):
    return None if name is None else f"{name}.grad"


def _inputs(values):
    """``values`` as arrays: traced ones as they are, others checked (host memory, a dtype rvod exchanges)."""
    return [v if isinstance(v, _Tracer) else as_array(v) for v in values]


def _like(x, shape=None):
    return jax.ShapeDtypeStruct(x.shape if shape is None else shape, x.dtype)


def _run(eager, inputs, shapes, staged):
    """``eager(adapter, *inputs)`` now, or, while tracing, as an ordered host callback returning ``shapes``."""
    if not staged:
        return eager(_adapter, *inputs)
    return io_callback(functools.partial(_in_callback, eager), shapes, *inputs, ordered=True)


def _in_callback(eager, *xs):
    """``eager`` run by the compiled program: its results may be NumPy arrays (see ``HostResultsAdapter``),
    unless they are bfloat16 (an op's results have its inputs' dtypes)."""
    bfloat16 = any(x.dtype == jnp.bfloat16 for x in xs)
    return eager(_adapter if bfloat16 else _host_results, *xs)


def _zero_cotangent(x):
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _differentiable(forward, backward, inputs):
    """``forward(inputs)`` (a list of arrays in, a list out) whose vector-Jacobian product is
    ``backward(cotangents)``, where ``inputs`` are traced; integer inputs get no cotangent."""
    if not any(isinstance(x, _Tracer) for x in inputs):
        return forward(inputs)
    integral = [not jnp.issubdtype(x.dtype, jnp.inexact) for x in inputs]
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]

    @jax.custom_vjp
    def op(xs):
        return forward(xs)

    def fwd(xs):
        return forward(xs), None

    def bwd(_, cotangents):
        grads = backward(list(cotangents))
        return ([_zero_cotangent(a) if i else g for a, i, g in zip(avals, integral, grads)],)

    op.defvjp(fwd, bwd)
    return op(list(inputs))


def _set_size(process_set):
    process_set_id_of(process_set)
    return len(process_set.ranks)


def _tree(tensors, what):
    leaves, treedef = jax.tree_util.tree_flatten(tensors)
    if not leaves:
        raise RvodInvalidArgumentError(f"{what} needs at least one tensor")
    return leaves, treedef


# ------------------------------------------------------------------------------------------------ allreduce


def _allreduce(tensors, name, op, prescale_factor, postscale_factor, process_set, grouped):
    """Allreduce of a list of arrays (one op, or one grouped op); returns a list."""

    def eager(adapter, *xs):
        if grouped:
            return _ops.wait_for(_ops.grouped_allreduce_async, adapter, list(xs), None, name, op, prescale_factor,
                                 postscale_factor, process_set)
        return [_ops.allreduce(adapter, xs[0], None, name, op, prescale_factor, postscale_factor, process_set)]

    def forward(xs):
        staged = _staged(xs)
        return _run(eager, xs, [_like(x) for x in xs], staged)

    def backward(cotangents):
        return _allreduce(cotangents, _grad_name(name), op, prescale_factor, postscale_factor, process_set, grouped)

    return _differentiable(forward, backward, tensors)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default: Average) into a new array; differentiable."""
    op = resolve_op(op, average)
    tensors = _inputs([tensor])
    name = _name(name, _staged(tensors))
    return _allreduce(tensors, name, op, prescale_factor, postscale_factor, process_set, False)[0]


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduce every array of the pytree ``tensors`` as one unit (the engine fuses them); returns the same
    structure; differentiable."""
    op = resolve_op(op, average)
    leaves, treedef = _tree(tensors, "grouped_allreduce")
    leaves = _inputs(leaves)
    name = _name(name, _staged(leaves))
    reduced = _allreduce(leaves, name, op, prescale_factor, postscale_factor, process_set, True)
    return jax.tree_util.tree_unflatten(treedef, reduced)


# ------------------------------------------------------------------------------------------------ allgather


def _rows(x):
    return x.shape[0] if x.ndim else 1


def _traced_rows(xs, process_set, expected):
    """Inside jit, the first dimensions every rank gives, one list per array: ``expected``, or by default
    this rank's on every rank."""
    for x in xs:
        if not x.ndim:
            raise RvodInvalidArgumentError("allgather needs a tensor with at least one dimension, got a scalar")
    count = _set_size(process_set)
    return [[_rows(x)] * count if e is None else list(e) for x, e in zip(xs, expected or [None] * len(xs))]


def _allgather(tensors, name, process_set, grouped, expected=None):
    """Allgather of a list of arrays; inside jit every rank's first dimensions are ``expected`` (see
    ``_traced_rows``), checked on every rank when it runs."""

    def eager(adapter, *xs):
        if grouped:
            return _ops.wait_for(_ops.grouped_allgather_async, adapter, list(xs), name, process_set)
        return [_ops.allgather(adapter, xs[0], name, process_set)]

    def forward(xs):
        staged = _staged(xs)
        if not staged:
            return eager(_adapter, *xs)
        rows = _traced_rows(xs, process_set, expected)

        def checked(adapter, *xs):
            # Every rank's first dimensions travel with the data (one grouped op), so that every rank sees
            # that they differ from those traced for, and all of them raise.
            sent = np.array([[_rows(x) for x in xs]], dtype=np.int32)
            *gathered, given = _ops.wait_for(_ops.grouped_allgather_async, adapter, [*xs, sent], name,
                                             process_set)
            given = np.asarray(given).T.tolist()
            if given != rows:
                one = len(xs) == 1
                raise RvodMismatchError(
                    f"{'allgather' if one else 'grouped_allgather'} {name}: inside jax.jit its output shape is fixed "
                    f"when tracing, for first dimensions {rows[0] if one else rows} across the ranks of the set, but "
                    f"they gave {given[0] if one else given}; allgather arrays of different first dimensions "
                    "outside jit, or pad them to the same size")
            return gathered

        return _run(checked, xs, [_like(x, (sum(r), *x.shape[1:])) for x, r in zip(xs, rows)], True)

    own_rows = [_rows(x) for x in tensors]

    def backward(cotangents):
        reduced = _allreduce(cotangents, _grad_name(name), Average, 1.0, 1.0, process_set, grouped)
        return _own_rows(reduced, own_rows, process_set, expected)

    return _differentiable(forward, backward, tensors)


def _own_rows(gathered, own_rows, process_set, expected):
    """The rows of each gathered array (rows of every rank, in rank order) that this rank contributed.
    Inside jit every rank's first dimensions are known (``expected``, or this rank's on every rank);
    eagerly they are allgathered."""
    me = process_set.rank()
    if _staged(gathered):
        rows = expected or [[own] * _set_size(process_set) for own in own_rows]
        offsets = [sum(r[:me]) for r in rows]
    else:
        counts = _ops.allgather(_adapter, np.asarray([own_rows], dtype=np.int32), None, process_set)
        offsets = np.asarray(counts)[:me].sum(axis=0).tolist() if me else [0] * len(own_rows)
    return [jax.lax.slice_in_dim(g, offset, offset + count) for g, offset, count in zip(gathered, offsets, own_rows)]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ, outside jit);
    differentiable."""
    tensors = _inputs([tensor])
    name = _name(name, _staged(tensors))
    return _allgather(tensors, name, process_set, False)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather every array of the pytree ``tensors`` as one unit; returns the same structure; differentiable."""
    leaves, treedef = _tree(tensors, "grouped_allgather")
    leaves = _inputs(leaves)
    name = _name(name, _staged(leaves))
    return jax.tree_util.tree_unflatten(treedef, _allgather(leaves, name, process_set, True))


# ------------------------------------------------------------------------------------------------ broadcast


def _broadcast(tensor, root_rank, name, process_set):
    def eager(adapter, x):
        return [_ops.broadcast(adapter, x, root_rank, name, process_set)]

    def forward(xs):
        staged = _staged(xs)
        return _run(eager, xs, [_like(xs[0])], staged)

    def backward(cotangents):
        grad = _allreduce(cotangents, _grad_name(name), Average, 1.0, 1.0, process_set, False)[0]
        return [grad if rank() == root_rank else jnp.zeros_like(grad)]

    return _differentiable(forward, backward, [tensor])[0]


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (``root_rank`` is a global rank); differentiable."""
    tensors = _inputs([tensor])
    return _broadcast(tensors[0], int(root_rank), _name(name, _staged(tensors)), process_set)


# ------------------------------------------------------------------------------------------------- alltoall


def _alltoall(tensor, splits, name, process_set):
    """``(output, received_splits)``: ``received_splits`` a list of ints (None inside jit)."""
    received = []  # the splits the last run received (a compiled program runs this closure again and again)

    def eager(adapter, x):
        output, got = _ops.wait_for(_ops.alltoall_async, adapter, x, splits, name, process_set, True)
        received[:] = [[int(v) for v in got]]
        return [output]

    def checked(adapter, x):
        output, = eager(adapter, x)
        even = [x.shape[0] // len(received[-1])] * len(received[-1]) if x.ndim else []
        if received[-1] != even:
            raise RvodMismatchError(
                f"alltoall {name}: inside jax.jit it splits evenly and its output has the input's shape "
                f"{tuple(x.shape)}, but this rank received {received[-1]} rows from the ranks of the set; give every "
                "rank the same first dimension, or call alltoall with splits outside jit")
        return [output]

    def forward(xs):
        if not _staged(xs):
            return eager(_adapter, *xs)
        if splits is not None:
            raise RvodInvalidArgumentError(
                "alltoall inside jax.jit takes no splits: its output's shape is fixed when tracing, so it splits dim "
                "0 evenly (the output has the input's shape); call it outside jit to send uneven splits")
        return _run(checked, xs, [_like(xs[0])], True)

    def backward(cotangents):
        back = None if _staged(cotangents) else received[-1]
        return [_alltoall(cotangents[0], back, _grad_name(name), process_set)[0]]

    output = _differentiable(forward, backward, [tensor])[0]
    return output, (received[-1] if received else None)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows of dim 0 to rank i (an even split when None) and gather what the others
    send; differentiable. Returns the output, or ``(output, received_splits)`` (an int32 array) when
    ``splits`` is given. Inside jit: an even split only (``splits`` None)."""
    tensor, = _inputs([tensor])
    if splits is not None:
        splits = _adapter.to_int_list(splits)
    output, received = _alltoall(tensor, splits, _name(name, _staged([tensor])), process_set)
    return output if splits is None else (output, _adapter.received_splits(received))


# -------------------------------------------------------------------------------------------- reducescatter


def _check_scatter_op(op):
    if op not in (Average, Sum):
        raise RvodInvalidArgumentError("Reducescatter currently only supports Average and Sum")


def _reducescatter_grad(gathered, op, prescale_factor, postscale_factor, process_set):
    scale = prescale_factor * postscale_factor * (_set_size(process_set) if op == Sum else 1)
    return gathered if scale == 1 else gathered * np.asarray(scale, dtype=gathered.dtype)


def _shares(rows, process_set):
    """The rows of a first dimension of ``rows`` each rank of the set gets from a reducescatter."""
    count = _set_size(process_set)
    return [stop - start for start, stop in (chunk(rows, count, r) for r in range(count))]


def _reducescatter(tensors, name, op, prescale_factor, postscale_factor, process_set, grouped):
    def eager(adapter, *xs):
        if grouped:
            return _ops.wait_for(_ops.grouped_reducescatter_async, adapter, list(xs), name, op, process_set,
                                 prescale_factor, postscale_factor)
        return [_ops.wait_for(_ops.reducescatter_async, adapter, xs[0], name, op, process_set, prescale_factor,
                              postscale_factor)]

    def forward(xs):
        staged = _staged(xs)
        if not staged:
            return eager(_adapter, *xs)
        me = process_set.rank()
        return _run(eager, xs, [_like(x, (_shares(_rows(x), process_set)[me], *x.shape[1:])) for x in xs], True)

    shapes = [x.shape for x in tensors]

    def backward(cotangents):
        shares = [_shares(shape[0] if shape else 1, process_set) for shape in shapes]
        gathered = _allgather(cotangents, _grad_name(name), process_set, grouped, shares)
        return [_reducescatter_grad(g, op, prescale_factor, postscale_factor, process_set) for g in gathered]

    return _differentiable(forward, backward, tensors)


def reducescatter(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce across ranks, then give rank r its share of dim 0 (the first ranks take the extra rows);
    differentiable. Only Average and Sum."""
    op = resolve_op(op, None)
    _check_scatter_op(op)
    tensors = _inputs([tensor])
    name = _name(name, _staged(tensors))
    return _reducescatter(tensors, name, op, prescale_factor, postscale_factor, process_set, False)[0]


def grouped_reducescatter(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reducescatter every array of the pytree ``tensors`` as one unit; returns the same structure;
    differentiable."""
    op = resolve_op(op, None)
    _check_scatter_op(op)
    leaves, treedef = _tree(tensors, "grouped_reducescatter")
    leaves = _inputs(leaves)
    name = _name(name, _staged(leaves))
    reduced = _reducescatter(leaves, name, op, prescale_factor, postscale_factor, process_set, True)
    return jax.tree_util.tree_unflatten(treedef, reduced)


# ---------------------------------------------------------------------------------------- join and barrier


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier (inside jit: when the program reaches it)."""
    if not _staged([]):
        _ops.barrier(process_set)
        return
    process_set_id_of(process_set)

    def eager():
        _ops.barrier(process_set)

    io_callback(eager, None, ordered=True)


def join():
    """Signal that this rank has no more data; blocks until every rank has joined. Meanwhile allreduces
    submitted by the other ranks complete with this rank contributing zeros. Returns the last rank to join.
    Eagerly only (a traced function cannot stop taking part in collectives)."""
    if not _staged([]):
        return _ops.join()
    raise RvodInvalidArgumentError("join() runs eagerly; call it outside jax.jit")
