"""DistributedOptimizer(op=Adasum) for Keras 3: ranks combine their parameter *updates* with Adasum instead
of averaging gradients, as Horovod's ``_DistributedAdasumOptimizer`` does for PyTorch and TensorFlow 1
(Horovod's Keras optimizer refuses Adasum; rvod's accepts it).

Every update step remembers the trainable variables' values, lets the wrapped optimizer step with the
local gradients, combines the updates (new value - old value) across ranks with one grouped Adasum
allreduce, and sets each variable to its old value plus the combined update, the same on every rank.
With ``backward_passes_per_step`` N > 1 the optimizer's gradient accumulation adds up N local gradients
and this happens on every N-th step only, with their sum (or their mean with
``average_aggregated_gradients``), as for Average. Registered local variables keep their local update.
Works eagerly and inside Keras' ``tf.function`` train step (where TensorFlow orders the reads and
assignments of each variable as written), and with Keras' torch backend.
"""

import keras

from rvod.keras.optimizer_base import KerasSpellings, refuse_xla


class DistributedAdasumOptimizer(KerasSpellings):
    """Mixed in before the wrapped optimizer's class; see the module docstring."""

    _rvod_reducer = None
    _rvod_gradient_scale = 1.0

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        refuse_xla()
        variables = list(trainable_variables)
        if self._rvod_gradient_scale != 1.0:
            grads = [g * self._rvod_gradient_scale for g in grads]
        starts = [keras.ops.copy(v.value) for v in variables]
        super()._backend_update_step(grads, variables, learning_rate)
        updates = [keras.ops.subtract(v.value, start) for v, start in zip(variables, starts)]
        combined = self._rvod_reducer(updates, variables)
        for variable, start, update in zip(variables, starts, combined):
            variable.assign(keras.ops.add(start, update))

    def register_local_var(self, var):
        """Keep ``var``'s update local (not combined)."""
        self._rvod_reducer.register_local_variable(var)
