"""Elastic training for TensorFlow 2 (``hvd.elastic`` in ``import rvod.tensorflow as hvd``), as
``horovod.tensorflow.elastic``: ``TensorFlowKerasState`` commits a built tf.keras model (Keras 3 on the
TensorFlow backend, or tf_keras) with its optimizer, ``TensorFlowState`` a list of eager ``tf.Variable``s,
each with named objects. Their logic (NumPy copies of the values, rank 0's broadcast by ``sync()``, an
optimizer built before its first step) and the run loop are ``rvod.common.elastic``'s; this module gives
them TensorFlow's ops.
"""

import functools

from rvod.common.basics import init, rank, shutdown
from rvod.common.elastic import ObjectState, State, reset_engine, run_fn
from rvod.common.elastic_variables import KerasModelState, VariablesState
from rvod.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


def _broadcast_object(obj, root_rank, name):
    return broadcast_object(obj, root_rank, name=name)


class _TensorFlowOps:
    """How the states below read and broadcast TensorFlow variables (eagerly)."""

    def _to_numpy(self, variable):
        return variable.numpy()

    def _broadcast(self, variables):
        broadcast_variables(variables, root_rank=0)


class TensorFlowKerasState(_TensorFlowOps, KerasModelState):
    """A built tf.keras ``model``, its ``optimizer`` (default ``model.optimizer``) and keyword arguments,
    committed together. ``backend`` is Horovod's TensorFlow 1 session holder: accepted, not needed eagerly.
    ValueError when the model is not built."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=backend, bcast_object=_broadcast_object,
                         get_rank=rank, **kwargs)


class TensorFlowState(_TensorFlowOps, VariablesState):
    """``variables`` (eager ``tf.Variable``s) and keyword arguments, committed together. ``session`` is
    Horovod's TensorFlow 1 argument: graphs under a Session are not supported here."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError("TensorFlowState works on eager variables; TensorFlow 1 sessions are not supported")
        self.variables = list(variables or [])
        super().__init__(bcast_object=_broadcast_object, get_rank=rank, **kwargs)

    def _tracked(self):
        return self.variables


def run(func):
    """Decorator for ``func(state, ...)``: see ``rvod.common.elastic.run_fn``. A collective that failed
    inside a ``tf.function`` reaches it as a ``tf.errors.OpError`` naming the RvodInternalError (as
    Horovod's turns such errors into HorovodInternalError), and is recovered from as one."""
    import tensorflow as tf

    return run_fn(func, functools.partial(reset_engine, shutdown, init), (tf.errors.OpError,))
