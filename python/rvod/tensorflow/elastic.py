"""Elastic training for TensorFlow 2 (``hvd.elastic`` in ``import rvod.tensorflow as hvd``), as
``horovod.tensorflow.elastic``: ``TensorFlowState`` commits a list of ``tf.Variable`` (eagerly) with named
objects; ``TensorFlowKerasState`` is ``rvod.keras.elastic.KerasState``. The state and the run loop are
``rvod.common.elastic``'s.
"""

import functools

from rvod.common.basics import init, rank, shutdown
from rvod.common.elastic import ObjectState, State, reset_engine, run_fn
from rvod.keras.elastic import KerasState as TensorFlowKerasState
from rvod.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


class TensorFlowState(ObjectState):
    """``variables`` (eager ``tf.Variable``s) and keyword arguments, committed together. ``session`` is
    Horovod's TensorFlow 1 argument: graphs under a Session are not supported here."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError("TensorFlowState works on eager variables; TensorFlow 1 sessions are not supported")
        self.variables = list(variables or [])
        self._save_variables()
        super().__init__(bcast_object=lambda obj, root, name: broadcast_object(obj, root, name=name),
                         get_rank=rank, **kwargs)

    def _save_variables(self):
        self._saved_values = [variable.numpy().copy() for variable in self.variables]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for variable, value in zip(self.variables, self._saved_values):
            variable.assign(value)
        super().restore()

    def sync(self):
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._save_variables()
        super().sync()


def run(func):
    """Decorator for ``func(state, ...)``: see ``rvod.common.elastic.run_fn``."""
    return run_fn(func, functools.partial(reset_engine, shutdown, init))
