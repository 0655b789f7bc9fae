"""Making every rank start from the same state: variables (eagerly, in ``tf.function`` and in tf.compat.v1
graphs, with ``BroadcastGlobalVariablesHook`` for a ``MonitoredTrainingSession``) and arbitrary picklable
objects."""

import tensorflow as tf

from rvod.common import objects as _objects
from rvod.common.process_sets import global_process_set
from rvod.tensorflow.mpi_ops import _executing_eagerly, broadcast_values


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign ``root_rank``'s values to ``variables`` (all broadcast at once, so the engine fuses them).
    Eagerly returns None; inside a ``tf.function`` returns an op grouping the assignments. ``inplace`` is
    Horovod's and makes no difference here."""
    variables = list(variables)
    values = broadcast_values(variables, root_rank, process_set=process_set)
    assignments = [variable.assign(value) for variable, value in zip(variables, values)]
    return None if _executing_eagerly() else tf.group(*[a for a in assignments if a is not None])


def broadcast_global_variables(root_rank):
    """An op assigning ``root_rank``'s values to the default graph's global variables
    (``tf.compat.v1.global_variables()``); run it in a Session after initialising them. TensorFlow 1 graphs
    only, as in Horovod: eagerly, broadcast the variables you have."""
    if _executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``SessionRunHook`` (``MonitoredTrainingSession``, Estimator) that broadcasts every global variable
    from ``root_rank`` once the session is created, so all ranks start from the same weights whether they
    were initialised at random or restored from a checkpoint. ``device`` is Horovod's and ignored (this
    build runs collectives on the CPU)."""

    def __init__(self, root_rank, device=''):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


def _outside_tf_function(what):
    if tf.inside_function():
        raise RuntimeError(f"{what} exchanges Python objects when it is called; call it outside tf.function")


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``root_rank``'s picklable object on every rank, eagerly or in a TensorFlow 1 graph (where it
    runs at once, as Horovod's does through ``session``, which is accepted and not needed); unnamed calls
    match across ranks by call order."""
    _outside_tf_function("broadcast_object")
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts its argument from ``root_rank`` (Horovod's TF1 helper; each call is a
    new broadcast)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """A list with every rank's picklable object, in rank order (unnamed calls match by call order);
    eagerly or in a TensorFlow 1 graph, as ``broadcast_object``."""
    _outside_tf_function("allgather_object")
    return _objects.allgather_object(obj, name, process_set)
