"""Horovod's collective ops on TensorFlow tensors, eagerly, inside ``tf.function`` and in ``tf.compat.v1``
graphs run by a Session, with Horovod's gradients.

Eagerly an op calls the engine at once. In a graph (a ``tf.function`` being traced, or a v1 graph) an op
becomes one ``tf.py_function`` node running the same eager code when the graph executes. Inside a
``tf.function`` these stateful nodes run in program order (TensorFlow's automatic control dependencies);
in a v1 graph they run when a ``Session.run`` needs them, in any order, as Horovod's ops do. An unnamed op
is named when the graph is built after its graph and its position there (``graph.<function>.<n>``, or
``graph.v1.<n>`` in a v1 graph, which ranks build in the same order, as Horovod's node names assume), so
ranks match it however often each of them traced. No TensorFlow op is compiled: one wheel serves every
TensorFlow version.

In a v1 graph a collective waits for the other ranks on a thread of its own, not on one of the Session's
inter-op threads (see ``session_node``), so one ``Session.run`` can run any number of them, whatever the
Session's ``inter_op_parallelism_threads``.

Gradients (``tf.custom_gradient``), as Horovod defines them:

- allreduce: the gradient is allreduced with the same op and scale factors;
- allgather: the gradient is averaged across ranks and each rank keeps the rows of its own input;
- broadcast: the gradient is averaged across ranks on the root and zero on the other ranks;
- alltoall: the gradient travels back along the received splits;
- reducescatter: the gradient is allgathered (times the set size for Sum) and scaled like the input.

Names, argument orders and defaults are ``horovod.tensorflow``'s; ``device_dense``/``device_sparse`` are
accepted and ignored (this build is CPU-only).
"""

import itertools
import weakref

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from rvod.common import ops as _ops
from rvod.common.basics import *  # noqa: F401,F403  (the basics, re-exported)
from rvod.common.basics import __all__ as _basics
from rvod.common.basics import local_rank, local_size, rank
from rvod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    process_set_id_of,
    registered_process_set,
    remove_process_set,
)
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum, resolve_op  # noqa: F401
from rvod.exceptions import RvodInvalidArgumentError, RvodMismatchError
from rvod.tensorflow.adapter import MismatchError, TensorFlowAdapter, as_tensor
from rvod.common.compression import engine_code
from rvod.tensorflow.compression import Compression
from rvod.tensorflow.session_node import session_node

__all__ = _basics + [
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier", "size_op", "local_size_op", "rank_op",
    "local_rank_op", "process_set_included_op", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product",
]

_adapter = TensorFlowAdapter()
_graph_counters = weakref.WeakKeyDictionary()


def _executing_eagerly():
    """Whether ops run now (True) or are being added to a graph (False)."""
    return tf.executing_eagerly()


def _wait(handle):
    try:
        return _ops.synchronize(handle)
    except MismatchError:
        raise
    except RvodMismatchError as error:
        raise MismatchError(str(error)) from error


def _op_name(name, ignore_name_scope=False):
    """The name ranks match an op by; None eagerly for an unnamed op (the engine's call-order counter)."""
    if name is None:
        if tf.executing_eagerly():
            return None
        graph = tf.compat.v1.get_default_graph()
        # A branch of tf.cond or a tf.while_loop body counts in the graph around it: its own name carries a
        # process-wide id, which differs between ranks.
        while isinstance(graph, ControlFlowFuncGraph) and graph.outer_graph is not None:
            graph = graph.outer_graph
        counter = _graph_counters.setdefault(graph, itertools.count(1))
        # A tf.function's graph has the function's name; a tf.compat.v1.Graph has none.
        return f"graph.{getattr(graph, 'name', None) or 'v1'}.{next(counter)}"
    scope = "" if ignore_name_scope else tf.get_current_name_scope()
    return f"{scope.rstrip('/')}/{name}" if scope else str(name)


def _run(eager_fn, inputs, dtypes, shapes):
    """``eager_fn(*inputs)`` returning a list of tensors: called now when executing eagerly, otherwise added
    to the graph being built as one node whose outputs get the given static shapes."""
    if tf.executing_eagerly():
        return eager_fn(*inputs)
    eager_fn = tf.autograph.experimental.do_not_convert(eager_fn)
    if tf.compat.v1.executing_eagerly_outside_functions():
        # A tf.function called eagerly runs its py_functions one at a time, in program order.
        outputs = tf.py_function(eager_fn, list(inputs), list(dtypes))
    else:
        outputs = session_node(eager_fn, inputs, dtypes)
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    return outputs


def _differentiable(forward, backward, *inputs):
    """``forward(*inputs)`` with ``backward(*output_gradients)`` as its gradient (tf.custom_gradient),
    skipping the gradient machinery when executing eagerly with no tape recording."""
    if tf.executing_eagerly() and not record.could_possibly_record():
        return forward(*inputs)

    @tf.custom_gradient
    def op(*xs):
        return forward(*xs), backward

    return op(*inputs)


def _set_size(process_set):
    process_set_id_of(process_set)
    return len(process_set.ranks)


# ------------------------------------------------------------------------------------------------ allreduce


def _allreduce_dense(tensor, name, op, prescale_factor, postscale_factor, process_set, compression=0):
    """``compression``: the engine's code (see ``rvod.common.compression``); the gradient is reduced alike."""
    def eager(t):
        return [_wait(_ops.allreduce_async(_adapter, t, None, name, op, prescale_factor, postscale_factor,
                                           process_set, False, compression))]

    def grad(dy):
        return _allreduce_dense(tf.convert_to_tensor(dy), _op_name(None), op, prescale_factor, postscale_factor,
                                process_set, compression)

    return _differentiable(lambda x: _run(eager, [x], [x.dtype], [x.shape])[0], grad, tensor)


def _allreduce_sparse(slices, op, prescale_factor, postscale_factor, name, process_set):
    """tf.IndexedSlices are reduced by allgathering their values and indices, as Horovod does."""
    if op not in (Sum, Average):
        raise NotImplementedError("allreduce of tf.IndexedSlices supports only Sum and Average; "
                                  "use sparse_as_dense=True or convert to a dense tensor")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("allreduce of tf.IndexedSlices does not support prescale_factor or "
                                  "postscale_factor; use sparse_as_dense=True")
    values = _allgather(as_tensor(slices.values, "allreduce"), None if name is None else f"{name}.values",
                        process_set)
    indices = _allgather(as_tensor(slices.indices, "allreduce"), None if name is None else f"{name}.indices",
                         process_set)
    if op == Average:
        count = _set_size(process_set)
        values = values / count if values.dtype.is_floating else values // count
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` across ranks (default: Average); differentiable. ``tf.IndexedSlices`` are gathered
    (Sum and Average only) and come back as ``tf.IndexedSlices``."""
    op = resolve_op(op, average)
    process_set_id_of(process_set)
    name = _op_name(name, ignore_name_scope)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor, name, process_set)
    compressed, context = compression.compress(as_tensor(tensor, "allreduce"))
    reduced = _allreduce_dense(compressed, name, op, prescale_factor, postscale_factor, process_set,
                               engine_code(compression, [compressed]))
    return compression.decompress(reduced, context)


def _grouped_allreduce_dense(tensors, name, op, prescale_factor, postscale_factor, process_set, compression=0):
    def eager(*ts):
        return _wait(_ops.grouped_allreduce_async(_adapter, list(ts), None, name, op, prescale_factor,
                                                  postscale_factor, process_set, False, compression))

    def grad(*dys):
        return _grouped_allreduce_dense([tf.convert_to_tensor(d) for d in dys], _op_name(None), op, prescale_factor,
                                        postscale_factor, process_set, compression)

    forward = lambda *xs: _run(eager, xs, [x.dtype for x in xs], [x.shape for x in xs])  # noqa: E731
    return list(_differentiable(forward, grad, *tensors))


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce a list of tensors as one unit (fused); returns a list; differentiable. ``tf.IndexedSlices``
    in the list are gathered as ``allreduce`` does."""
    op = resolve_op(op, average)
    process_set_id_of(process_set)
    tensors = list(tensors)
    if not tensors:
        return []
    name = _op_name(name, ignore_name_scope)
    results = list(tensors)
    dense = []
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, tf.IndexedSlices):
            results[i] = _allreduce_sparse(tensor, op, prescale_factor, postscale_factor,
                                           None if name is None else f"{name}.sparse_{i}", process_set)
        else:
            dense.append((i, compression.compress(as_tensor(tensor, "grouped_allreduce"))))
    if dense:
        wire = [c for _, (c, _) in dense]
        reduced = _grouped_allreduce_dense(wire, name, op, prescale_factor, postscale_factor, process_set,
                                           engine_code(compression, wire))
        for (i, (_, context)), value in zip(dense, reduced):
            results[i] = compression.decompress(value, context)
    return results


# ------------------------------------------------------------------------------------------------ allgather


def _gathered_shape(shape):
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else tf.TensorShape([None])


def _own_rows(grads, row_counts, process_set):
    """The rows of each gathered gradient (rows of every rank, in rank order) that this rank contributed;
    ``row_counts`` are the first dimensions of this rank's inputs."""
    counts = tf.reshape(tf.stack([tf.cast(c, tf.int64) for c in row_counts]), [1, -1])
    everyone = _allgather(counts, _op_name(None), process_set)
    offsets = tf.reduce_sum(everyone[:process_set.rank()], axis=0)
    return [g[offsets[i]:offsets[i] + tf.cast(row_counts[i], tf.int64)] for i, g in enumerate(grads)]


def _rows(x):
    return tf.shape(x)[0] if x.shape.rank != 0 else tf.constant(1)


def _allgather(tensor, name, process_set):
    def eager(t):
        return [_wait(_ops.allgather_async(_adapter, t, name, process_set))]

    def grad(dy):
        reduced = _allreduce_dense(tf.convert_to_tensor(dy), _op_name(None), Average, 1.0, 1.0, process_set)
        return _own_rows([reduced], [_rows(tensor)], process_set)[0]

    return _differentiable(lambda x: _run(eager, [x], [x.dtype], [_gathered_shape(x.shape)])[0], grad, tensor)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ); differentiable."""
    process_set_id_of(process_set)
    return _allgather(as_tensor(tensor, "allgather"), _op_name(name, ignore_name_scope), process_set)


def _grouped_allgather(tensors, name, process_set):
    def eager(*ts):
        return _wait(_ops.grouped_allgather_async(_adapter, list(ts), name, process_set))

    def grad(*dys):
        reduced = _grouped_allreduce_dense([tf.convert_to_tensor(d) for d in dys], _op_name(None), Average, 1.0, 1.0,
                                           process_set)
        return _own_rows(reduced, [_rows(x) for x in tensors], process_set)

    forward = lambda *xs: _run(eager, xs, [x.dtype for x in xs], [_gathered_shape(x.shape) for x in xs])  # noqa: E731
    return list(_differentiable(forward, grad, *tensors))


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Allgather a list of tensors as one unit; returns a list; differentiable."""
    process_set_id_of(process_set)
    tensors = [as_tensor(t, "grouped_allgather") for t in tensors]
    if not tensors:
        return []
    return _grouped_allgather(tensors, _op_name(name, ignore_name_scope), process_set)


# ------------------------------------------------------------------------------------------------ broadcast


def _broadcast(tensor, root_rank, name, process_set):
    def eager(t):
        return [_wait(_ops.broadcast_async(_adapter, t, root_rank, name, process_set))]

    def grad(dy):
        reduced = _allreduce_dense(tf.convert_to_tensor(dy), _op_name(None), Average, 1.0, 1.0, process_set)
        if rank() == root_rank:
            return reduced
        # Every rank must run the allreduce; in a v1 graph only what a result depends on runs.
        with tf.control_dependencies([reduced]):
            return tf.zeros_like(dy)

    return _differentiable(lambda x: _run(eager, [x], [x.dtype], [x.shape])[0], grad, tensor)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (``root_rank`` is a global rank); differentiable."""
    process_set_id_of(process_set)
    return _broadcast(as_tensor(tensor, "broadcast"), int(root_rank), _op_name(name, ignore_name_scope),
                      process_set)


def broadcast_values(tensors, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s values of several tensors, broadcast together (all in flight at once, so the engine
    fuses them); not differentiable."""
    process_set_id_of(process_set)
    tensors = [as_tensor(t, "broadcast") for t in tensors]
    if not tensors:
        return []
    names = [_op_name(None if name is None else f"{name}.{i}", ignore_name_scope=True) for i in range(len(tensors))]
    root_rank = int(root_rank)

    def eager(*ts):
        handles = [_ops.broadcast_async(_adapter, t, root_rank, n, process_set) for t, n in zip(ts, names)]
        return [_wait(h) for h in handles]

    return _run(eager, tensors, [t.dtype for t in tensors], [t.shape for t in tensors])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite each variable with ``root_rank``'s value. Eagerly returns the variables; in a graph, the
    variables' new values, which perform the broadcast when evaluated (as Horovod's in-place op)."""
    variables = list(variables)
    assigned = [variable.assign(value)
                for value, variable in zip(broadcast_values(variables, root_rank, name, process_set), variables)]
    return variables if tf.executing_eagerly() else [tf.identity(a) for a in assigned]


# ------------------------------------------------------------------------------------------------- alltoall


def _alltoall(tensor, splits, name, process_set):
    outputs = []

    def eager(t, split_tensor):
        split_list = None if splits is None else [int(v) for v in split_tensor.numpy().reshape(-1)]
        return list(_wait(_ops.alltoall_async(_adapter, t, split_list, name, process_set, with_splits=True)))

    def forward(x, s):
        outputs[:] = _run(eager, [x, s], [x.dtype, tf.int32], [_gathered_shape(x.shape), [_set_size(process_set)]])
        return outputs

    def grad(dy, _):
        back, _ = _alltoall(tf.convert_to_tensor(dy), outputs[1], _op_name(None), process_set)
        return back, None

    split_input = tf.zeros([0], tf.int32) if splits is None else tf.reshape(tf.cast(splits, tf.int32), [-1])
    return _differentiable(forward, grad, tensor, split_input)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[i]`` rows of dim 0 to rank i (an even split when None) and gather what the others send;
    differentiable. Returns the output, or ``(output, received_splits)`` when ``splits`` is given."""
    process_set_id_of(process_set)
    output, received = _alltoall(as_tensor(tensor, "alltoall"), splits, _op_name(name, ignore_name_scope),
                                 process_set)
    return output if splits is None else (output, received)


# -------------------------------------------------------------------------------------------- reducescatter


def _scattered_shape(shape, process_set):
    """Rank r of n gets rows // n rows, one more when r < rows % n."""
    if not shape.rank:
        return shape
    rows = shape[0]
    if rows is None:
        return _gathered_shape(shape)
    count, me = _set_size(process_set), process_set.rank()
    return tf.TensorShape([rows // count + (1 if me < rows % count else 0)]).concatenate(shape[1:])


def _check_scatter_op(op):
    if op not in (Average, Sum):
        raise RvodInvalidArgumentError("Reducescatter currently only supports Average and Sum")


def _reducescatter_grad(gathered, op, prescale_factor, postscale_factor, process_set):
    scale = prescale_factor * postscale_factor * (_set_size(process_set) if op == Sum else 1)
    return gathered if scale == 1 else gathered * tf.cast(scale, gathered.dtype)


def _reducescatter(tensor, name, op, prescale_factor, postscale_factor, process_set):
    def eager(t):
        return [_wait(_ops.reducescatter_async(_adapter, t, name, op, process_set, prescale_factor, postscale_factor))]

    def grad(dy):
        gathered = _allgather(tf.convert_to_tensor(dy), _op_name(None), process_set)
        return _reducescatter_grad(gathered, op, prescale_factor, postscale_factor, process_set)

    forward = lambda x: _run(eager, [x], [x.dtype], [_scattered_shape(x.shape, process_set)])[0]  # noqa: E731
    return _differentiable(forward, grad, tensor)


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce across ranks, then give rank r its share of dim 0 (the first ranks take the extra rows);
    differentiable. Only Average and Sum."""
    op = resolve_op(op, None)
    _check_scatter_op(op)
    process_set_id_of(process_set)
    compressed, context = compression.compress(as_tensor(tensor, "reducescatter"))
    reduced = _reducescatter(compressed, _op_name(name, ignore_name_scope), op, prescale_factor, postscale_factor,
                             process_set)
    return compression.decompress(reduced, context)


def _grouped_reducescatter(tensors, name, op, prescale_factor, postscale_factor, process_set):
    def eager(*ts):
        return _wait(_ops.grouped_reducescatter_async(_adapter, list(ts), name, op, process_set, prescale_factor,
                                                      postscale_factor))

    def grad(*dys):
        gathered = _grouped_allgather([tf.convert_to_tensor(d) for d in dys], _op_name(None), process_set)
        return [_reducescatter_grad(g, op, prescale_factor, postscale_factor, process_set) for g in gathered]

    shapes = [_scattered_shape(x.shape, process_set) for x in tensors]
    forward = lambda *xs: _run(eager, xs, [x.dtype for x in xs], shapes)  # noqa: E731
    return list(_differentiable(forward, grad, *tensors))


def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, name=None,
                          ignore_name_scope=False):
    """Reducescatter a list of tensors as one unit; returns a list; differentiable."""
    op = resolve_op(op, None)
    _check_scatter_op(op)
    process_set_id_of(process_set)
    compressed = [compression.compress(as_tensor(t, "grouped_reducescatter")) for t in tensors]
    if not compressed:
        return []
    reduced = _grouped_reducescatter([c for c, _ in compressed], _op_name(name, ignore_name_scope), op,
                                     prescale_factor, postscale_factor, process_set)
    return [compression.decompress(r, context) for r, (_, context) in zip(reduced, compressed)]


# ------------------------------------------------------------------------------ join, barrier, topology ops


def join():
    """Signal that this rank has no more data; blocks until every rank has joined (meanwhile the other
    ranks' allreduces complete with this rank contributing zeros). Returns the last rank to join, as an
    int32 scalar tensor."""
    return _run(lambda: [tf.constant(_ops.join(), tf.int32)], [], [tf.int32], [[]])[0]


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier."""
    process_set_id_of(process_set)

    def eager():
        _ops.barrier(process_set)
        return [tf.constant(True)]

    return _run(eager, [], [tf.bool], [[]])[0]


def _topology_op(value, name):
    with tf.name_scope(name or "rvod"):
        return _run(lambda: [tf.constant(value(), tf.int32)], [], [tf.int32], [[]])[0]


def _registered_set(process_set_id):
    process_set = registered_process_set(process_set_id)
    if process_set is None:
        raise ValueError(f"process set {process_set_id} does not exist, or has not been registered")
    return process_set


def size_op(process_set_id=0, name=None):
    """The size of a process set as an int32 tensor, read when the graph runs."""
    return _topology_op(lambda: len(_registered_set(process_set_id).ranks), name)


def local_size_op(name=None):
    return _topology_op(local_size, name)


def rank_op(name=None):
    return _topology_op(rank, name)


def local_rank_op(name=None):
    return _topology_op(local_rank, name)


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank belongs to the process set, else 0 (int32 tensor)."""
    return _topology_op(lambda: int(rank() in _registered_set(process_set_id).ranks), name)
