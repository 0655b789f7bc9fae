"""A collective as a node of a ``tf.compat.v1`` graph run by a Session, waiting for the other ranks without
holding one of the Session's inter-op threads.

A ``tf.py_function`` node is a synchronous kernel: it keeps its inter-op thread until its Python code returns.
A collective waiting there for the other ranks holds the thread, so a ``Session.run`` of more independent
collectives than the Session has inter-op threads (as many as cores by default, 1 or 2 when a user asks
so) deadlocks: each rank fills its pool with waits for collectives that the other ranks have not
submitted yet, their pools being full of waits for others (ranks start independent nodes in any order).
No compiled TensorFlow op is available (one wheel serves every TensorFlow version), so the node is made of
stock ops that TensorFlow already runs off the pool::

    DatasetToSingleElement(MapDataset(TensorDataset(index, *inputs), f, use_inter_op_parallelism=False))

where ``f`` is a py_function calling the collective's Python code (``index`` picks it; one ``f`` per signature
serves a whole graph). ``DatasetToSingleElement`` is an asynchronous kernel: its inter-op thread hands the work
to tf.data's unbounded thread pool (a new thread whenever none is idle) and returns at once. A map without
inter-op parallelism runs ``f`` on the thread that asks for the element (tf.data's single-threaded executor).
So the collective's Python code (submit, then wait) runs on a thread of its own.

Why a Session.run of any number of collectives completes, whatever the Session's thread count and the order
in which each rank starts its nodes:

1. No inter-op thread ever waits for another rank: the collectives' waits run on tf.data's threads, one each,
   and release the GIL while they block (``rvod.common.ops.synchronize``).
2. So on every rank every node whose inputs are ready runs within finite time; in particular a collective
   whose inputs are ready is submitted to the engine, however many other collectives are waiting.
3. The engine completes a collective once every rank has submitted it, whatever else is pending and in
   whatever order the ranks submitted (ranks match ops by name).
4. By induction over the collectives of the run in dependency order, which is the same on every rank (same
   graph, same fetches): those with no collective upstream are submitted on every rank (2) and complete (3);
   then so are those whose upstream collectives have completed, and so on.

A rank that never submits a collective (other fetches, a failed rank) still leaves the others waiting: the
engine's stall inspector names the tensor and the missing ranks (``RVOD_STALL_CHECK_TIME_SECONDS``).
"""

import weakref

import tensorflow as tf

# graph -> weak reference to its _Nodes. A graph keeps its _Nodes alive (the graph holds the Python functions
# of its py_functions, here _Nodes.run), and nothing here keeps a graph alive.
_graphs = weakref.WeakKeyDictionary()

# The map functions are instantiated on one device: the multi-device path would run Grappler on a copy of the
# function for every node of the graph (~15 ms each, in the Session's first run).
_SINGLE_DEVICE = {"experimental_ints_on_device": True}


class _Nodes:
    """The collectives of one graph: their Python code, and the map functions that run it, one per signature
    (input and output dtypes), shared by the collectives, each taking its collective's index first."""

    def __init__(self):
        self.calls = []
        self.functions = {}

    def run(self, index, *inputs):
        return self.calls[int(index)](*inputs)

    def function(self, input_dtypes, output_dtypes):
        key = (input_dtypes, output_dtypes)
        if key not in self.functions:
            def call(index, *inputs):
                return tuple(tf.py_function(self.run, [index, *inputs], list(output_dtypes)))

            signature = [tf.TensorSpec([], tf.int64)] + [tf.TensorSpec(None, dtype) for dtype in input_dtypes]
            traced = tf.function(call, input_signature=signature, autograph=False, experimental_attributes=_SINGLE_DEVICE)
            self.functions[key] = traced.get_concrete_function()
        return self.functions[key]


def _nodes(graph):
    nodes = _graphs.get(graph)
    nodes = nodes and nodes()
    if nodes is None:
        nodes = _Nodes()
        _graphs[graph] = weakref.ref(nodes)
    return nodes


def session_node(eager_fn, inputs, dtypes):
    """The outputs of one node, added to the current graph, that calls ``eager_fn(*inputs)`` (eager tensors in,
    a list of eager tensors out) on a thread outside the Session's inter-op pool when the graph runs."""
    dtypes = tuple(tf.as_dtype(dtype) for dtype in dtypes)
    nodes = _nodes(tf.compat.v1.get_default_graph())
    function = nodes.function(tuple(x.dtype for x in inputs), dtypes)
    nodes.calls.append(eager_fn)
    unknown = [tf.TensorShape(None)] * len(dtypes)
    with tf.device("/device:CPU:0"):
        index = tf.constant(len(nodes.calls) - 1, tf.int64)
        element = tf.raw_ops.TensorDataset(components=[index, *inputs],
                                           output_shapes=[[]] + [tf.TensorShape(None)] * len(inputs))
        mapped = tf.raw_ops.MapDataset(input_dataset=element, other_arguments=[], f=function, output_types=dtypes,
                                       output_shapes=unknown, use_inter_op_parallelism=False)
        return tf.raw_ops.DatasetToSingleElement(dataset=mapped, output_types=dtypes, output_shapes=unknown)
