"""DistributedOptimizer(op=Adasum) for TensorFlow 1 optimizers (``tf.compat.v1.train.Optimizer``), as
Horovod's ``_DistributedAdasumOptimizer``: ranks combine their parameter *updates* with Adasum instead of
averaging gradients.

``compute_gradients`` is the wrapped optimizer's (local gradients). Each run of ``apply_gradients``' op
lets the wrapped optimizer apply them locally; every ``backward_passes_per_step``-th run (every run by
default) combines each variable's change since the period began (new value - value at the period's
start) across ranks with one grouped Adasum allreduce and sets the variable to its start value plus the
combined change, the same on every rank. Works in tf.compat.v1 graphs run by a Session (the state is a
pair of local variables per period: initialise them with ``tf.compat.v1.local_variables_initializer()``,
as a MonitoredTrainingSession does, when N > 1) and eagerly.
"""

import tensorflow as tf

from rvod.common.gradients import check_backward_passes_per_step
from rvod.common.reduce_ops import Adasum
from rvod.tensorflow.gradients import GradientReducer

v1 = tf.compat.v1


class _Period:
    """Where each variable stood when the current period of ``steps`` local steps began, and how many
    steps it has had."""

    def __init__(self, variables):
        def local(initial_value, name):
            return v1.Variable(initial_value, trainable=False, name=name,
                               collections=[v1.GraphKeys.LOCAL_VARIABLES])

        with tf.name_scope("rvod_adasum_period"):
            self.counter = local(tf.constant(0, tf.int32), "counter")
            self.starts = [local(tf.zeros(v.shape, v.dtype.base_dtype), "start") for v in variables]


class DistributedAdasumLegacyOptimizer(v1.train.Optimizer):
    """An optimizer whose ranks combine their local updates with Adasum (see the module docstring)."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=None, backward_passes_per_step=1,
                 process_set=None):
        if name is None:
            name = f"DistributedAdasum{type(optimizer).__name__}"
        backward_passes_per_step = check_backward_passes_per_step(backward_passes_per_step)
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self._steps = backward_passes_per_step
        self._reducer = GradientReducer(compression, False, Adasum, 1.0, 0, None, process_set,
                                        scale_local_gradients=False, allow_adasum=True)
        self._periods = {}

    def register_local_var(self, var):
        """Keep ``var``'s update local (not combined)."""
        self._reducer.register_local_variable(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's local ``(gradient, variable)`` pairs."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def _period(self, variables):
        key = (id(tf.compat.v1.get_default_graph()) if not tf.executing_eagerly() else None,
               tuple(v.ref() for v in variables))
        if key not in self._periods:
            self._periods[key] = _Period(variables)
        return self._periods[key]

    def _combine(self, variables, starts):
        """Set every variable to its start plus the Adasum of the ranks' changes since the start."""
        changes = [v.read_value() - start for v, start in zip(variables, starts)]
        combined = self._reducer(changes, variables)
        return [v.assign(start + change) for v, start, change in zip(variables, starts, combined)]

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's local step, then (every ``backward_passes_per_step``-th run) the Adasum
        combination of the updates."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        if not variables:
            return self._optimizer.apply_gradients(pairs, global_step, name)
        with tf.name_scope(f"{self._name}_Adasum"):
            if self._steps == 1:
                starts = [tf.identity(v.read_value()) for v in variables]
                with tf.control_dependencies(starts):
                    applied = self._optimizer.apply_gradients(pairs, global_step, name)
                with tf.control_dependencies([applied]):
                    return tf.group(self._combine(variables, starts))
            period = self._period(variables)

            def begin():
                return tf.group([s.assign(v.read_value()) for s, v in zip(period.starts, variables)])

            began = tf.cond(tf.equal(period.counter.read_value(), 0), begin, tf.no_op)
            with tf.control_dependencies([began]):
                applied = self._optimizer.apply_gradients(pairs, global_step, name)
            with tf.control_dependencies([applied]):
                count = period.counter.assign_add(1, read_value=True)

            def combine():
                starts = [s.read_value() for s in period.starts]
                with tf.control_dependencies(self._combine(variables, starts)):
                    return tf.group(period.counter.assign(0))

            return tf.cond(tf.equal(count, self._steps), combine, tf.no_op)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
