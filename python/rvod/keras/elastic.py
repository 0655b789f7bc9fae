"""Elastic training for Keras 3 (``hvd.elastic`` in ``import rvod.keras as hvd``), as ``horovod.keras.elastic``.

``KerasState`` commits the model's and optimizer's variables (as NumPy copies) with any named objects;
the callbacks commit during ``model.fit`` and keep ``state.batch`` and ``state.epoch`` current, so a
restarted ``fit(initial_epoch=state.epoch)`` goes on with the next epoch. Keras 3 cannot start an epoch
part-way, so after a reset the interrupted epoch runs again from its first batch. The state and the run
loop are ``rvod.common.elastic``'s.
"""

import functools

import keras

from rvod.common.basics import init, rank, shutdown
from rvod.common.elastic import ObjectState, State, reset_engine, run_fn
from rvod.common.elastic_variables import KerasModelState
from rvod.common.objects import broadcast_object
from rvod.keras.callbacks import broadcast_variables

__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(KerasModelState):
    """A built Keras model, its optimizer (default ``model.optimizer``) and keyword arguments, committed
    together (``rvod.common.elastic.KerasModelState`` on Keras 3's own ops, so any backend). ``backend`` is
    accepted for Horovod compatibility."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=backend, bcast_object=broadcast_object, get_rank=rank,
                         **kwargs)

    def _to_numpy(self, variable):
        return keras.ops.convert_to_numpy(variable)

    def _broadcast(self, variables):
        broadcast_variables(variables, 0)


TensorFlowKerasState = KerasState


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches, and at the end of every epoch (after
    UpdateEpochStateCallback when that comes first in the list, so the commit holds the next epoch)."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the number of the last batch done in this epoch (0 between epochs)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Sets ``state.epoch`` to the next epoch when one ends (place it before CommitStateCallback), so
    ``fit(initial_epoch=state.epoch)`` after a reset does not repeat a finished epoch."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1


def run(func):
    """Decorator for ``func(state, ...)``: see ``rvod.common.elastic.run_fn``. On the TensorFlow backend a
    collective that failed inside the compiled train step reaches it as a ``tf.errors.OpError`` naming the
    RvodInternalError, and is recovered from as one."""
    wrapping = ()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        wrapping = (tf.errors.OpError,)
    return run_fn(func, functools.partial(reset_engine, shutdown, init), wrapping)
