"""Elastic training for Keras 3 (``hvd.elastic`` in ``import rvod.keras as hvd``), as ``horovod.keras.elastic``.

``KerasState`` commits the model's and optimizer's variables (as NumPy copies) with any named objects;
the callbacks commit during ``model.fit`` and keep ``state.batch`` and ``state.epoch`` current, so a
restarted ``fit(initial_epoch=state.epoch)`` goes on with the next epoch. Keras 3 cannot start an epoch
part-way, so after a reset the interrupted epoch runs again from its first batch. The state and the run
loop are ``rvod.common.elastic``'s.
"""

import functools

import keras
import numpy as np

from rvod.common.basics import init, rank, shutdown
from rvod.common.elastic import ObjectState, State, reset_engine, run_fn
from rvod.common.objects import broadcast_object
from rvod.keras.callbacks import _optimizer_variables, broadcast_variables

__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


class KerasState(ObjectState):
    """A Keras model, its optimizer (default ``model.optimizer``) and keyword arguments, committed together.
    ``backend`` is accepted for Horovod compatibility."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _variables(self):
        if self.optimizer is not None and not self.optimizer.built and self.model.built:
            # Ranks that have not trained yet build theirs, so every rank has the same variables to sync.
            self.optimizer.build(self.model.trainable_variables)
        return list(self.model.variables), _optimizer_variables(self.optimizer)

    def _save_model(self):
        model_vars, optimizer_vars = self._variables()
        self._saved_model, self._saved_optimizer = _values(model_vars), _values(optimizer_vars)

    def _load_model(self):
        model_vars, optimizer_vars = self._variables()
        for variables, saved in ((model_vars, self._saved_model), (optimizer_vars, self._saved_optimizer)):
            if len(variables) == len(saved):
                for variable, value in zip(variables, saved):
                    variable.assign(value)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        model_vars, optimizer_vars = self._variables()
        broadcast_variables(model_vars + optimizer_vars, 0)
        self._save_model()
        super().sync()


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
    """Decorator for ``func(state, ...)``: see ``rvod.common.elastic.run_fn``."""
    return run_fn(func, functools.partial(reset_engine, shutdown, init))
