"""Horovod's Keras callbacks for Keras 3 (any backend): broadcasting the initial state, averaging metrics,
and the learning-rate schedule and warm-up of Goyal et al., "Accurate, Large Minibatch SGD" (2017).

They exchange values as NumPy arrays through ``rvod.numpy`` (once per epoch, or once per training), so
they do not depend on the backend's tensors.
"""

import warnings

import keras
import numpy as np

import rvod.numpy as _np_ops
from rvod.common.basics import rank, size
from rvod.keras.sharded_state import is_sharded_slice


def broadcast_variables(variables, root_rank):
    """Assign ``root_rank``'s values to Keras (or backend) variables; all broadcasts are in flight at once.
    The slots of a sharded optimizer (this rank's slice of its state) are left out."""
    variables = [v for v in variables if not is_sharded_slice(v)]
    handles = [_np_ops.broadcast_async(np.array(keras.ops.convert_to_numpy(v), order="C"), root_rank)
               for v in variables]
    for variable, handle in zip(variables, handles):
        variable.assign(_np_ops.synchronize(handle))


def _optimizer_variables(optimizer):
    if optimizer is None or not getattr(optimizer, "built", True):
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)


def broadcast_optimizer(optimizer, root_rank, exclude=()):
    """``root_rank``'s optimizer state on every rank: its variables' values (but those whose id is in
    ``exclude``), or for a sharded optimizer its ``broadcast_state``."""
    if getattr(optimizer, "_rvod_sharding", None) is not None:
        if optimizer.built:
            optimizer.broadcast_state(root_rank)
        return
    broadcast_variables([v for v in _optimizer_variables(optimizer) if id(v) not in exclude], root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from ``root_rank``'s state: the model's variables when training begins, and
    the model's and optimizer's variables after the first batch (when the optimizer has built its own)."""

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self.local_variables = set()
        for variable in local_variables or []:
            self.register_local_var(variable)

    def register_local_var(self, var):
        """Leave ``var`` out of the broadcast."""
        self.local_variables.add(id(var))

    def _broadcast(self, with_optimizer):
        broadcast_variables([v for v in self.model.variables if id(v) not in self.local_variables], self.root_rank)
        if with_optimizer:
            broadcast_optimizer(self.model.optimizer, self.root_rank, self.local_variables)

    def on_train_begin(self, logs=None):
        self._broadcast(with_optimizer=False)

    def on_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast(with_optimizer=True)
            self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replaces each numeric entry of ``logs`` by its average over the ranks
    (put it before callbacks that read the metrics, such as ReduceLROnPlateau or TensorBoard)."""

    def __init__(self, device=''):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = _np_ops.allreduce(values, name=f"MetricAverageCallback.{epoch}", op=_np_ops.Average)
        for key, value in zip(keys, averaged.tolist()):
            logs[key] = value


def _learning_rate(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in ``[start_epoch, end_epoch)``.

    A constant ``multiplier`` m means ``m ** (epoch - start_epoch)``, changed at the start of each epoch.
    A callable one with ``staircase=False`` is evaluated before every batch at the fractional epoch
    ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` is taken from ``model.fit`` when not given).
    ``momentum_correction`` scales a variable ``momentum`` by new_lr / old_lr for that batch; Keras 3
    optimizers keep ``momentum`` as a Python float that the traced train step has baked in, so there it
    is skipped with a warning. The learning rate is logged as ``lr`` at the end of each epoch.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.staircase = True
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}().")

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _learning_rate(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and hasattr(optimizer, "momentum") and old_lr:
            momentum = optimizer.momentum
            if isinstance(momentum, keras.Variable):
                self.restore_momentum = float(keras.ops.convert_to_numpy(momentum))
                momentum.assign(self.restore_momentum * new_lr / old_lr)
            elif momentum and new_lr != old_lr and not getattr(self, "_warned_momentum", False):
                self._warned_momentum = True
                warnings.warn(f"{type(self).__name__}: momentum correction skipped; this optimizer's momentum is a "
                              "Python float, not a variable", stacklevel=2)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if not self._in_range(self.current_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size()`` up to ``initial_lr`` over ``warmup_epochs``
    epochs, batch by batch (the multiplier ``(epoch * (size - 1) / warmup_epochs + 1) / size``, the epoch
    shifted by one batch so that each epoch ends on a round value). ``verbose`` makes rank 0 say when the
    warm-up is done."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return (epoch * (size() - 1) / warmup_epochs + 1) / size()

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_learning_rate(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` that keeps only the best model; ``filepath`` is set later (Horovod's estimators
    set it), here through the ``filepath`` attribute."""

    def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto', save_freq='epoch'):
        super().__init__(filepath="best.keras" if not save_weights_only else "best.weights.h5", monitor=monitor,
                         verbose=verbose, save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
