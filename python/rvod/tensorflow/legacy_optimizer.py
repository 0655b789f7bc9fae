"""DistributedOptimizer for TensorFlow 1 optimizers (``tf.compat.v1.train.Optimizer``), as Horovod's.

The wrapper is itself a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` asks the wrapped optimizer
for its gradients and reduces them across ranks (one grouped allreduce per group, so in a graph that is
one node; ``tf.IndexedSlices`` gathered unless ``sparse_as_dense``; registered local variables kept
local); ``apply_gradients``, ``get_slot``, ``get_slot_names`` and ``variables`` are the wrapped
optimizer's, so ``minimize`` works too. Works in tf.compat.v1 graphs run by a Session and eagerly.

With ``backward_passes_per_step`` N > 1 (graphs only, as in Horovod) each run of the training op adds the
local gradients to accumulators (local variables: initialise them with
``tf.compat.v1.local_variables_initializer()``, as a MonitoredTrainingSession does); every N-th run
reduces the accumulated gradients across ranks (their sum, or their mean with
``average_aggregated_gradients``), applies them and clears the accumulators; the other runs apply nothing.
"""

import tensorflow as tf

from rvod.common.gradients import check_backward_passes_per_step
from rvod.tensorflow.gradients import GradientReducer

v1 = tf.compat.v1


class _LocalAggregation:
    """Accumulates gradients over ``steps`` runs and reduces them on the last one (see the module docstring)."""

    def __init__(self, steps, average):
        self.steps = steps
        self.average = average
        self.counter = None

    def _local_variable(self, initial_value, name):
        return v1.Variable(initial_value, trainable=False, name=name, collections=[v1.GraphKeys.LOCAL_VARIABLES])

    def gradients(self, grads, variables, reduce):
        """The gradients to apply: the reduced accumulated ones on every ``steps``-th run, else the running
        sums (which ``apply`` does not apply)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        with tf.name_scope("rvod_aggregation"):
            self.counter = self._local_variable(tf.constant(0, tf.int32), "counter")
            totals = [self._local_variable(tf.zeros(variables[i].shape, grads[i].dtype), "accumulator")
                      for i in present]
            added = [total.assign_add(tf.convert_to_tensor(grads[i])) for total, i in zip(totals, present)]
            with tf.control_dependencies(added):
                count = self.counter.assign_add(1, read_value=True)

            def communicate():
                summed = [total.read_value() for total in totals]
                reduced = reduce(summed, [variables[i] for i in present])
                if self.average:
                    reduced = [g / tf.cast(self.steps, g.dtype) for g in reduced]
                with tf.control_dependencies(reduced):
                    cleared = [total.assign(tf.zeros_like(total)) for total in totals] + [self.counter.assign(0)]
                with tf.control_dependencies(cleared):
                    return [tf.identity(g) for g in reduced]

            def accumulate():
                return [total.read_value() for total in totals]

            outputs = tf.cond(tf.equal(count, self.steps), communicate, accumulate) if present else []
        results = list(grads)
        for i, value in zip(present, outputs):
            results[i] = value
        return results

    def apply(self, grads, apply_fn):
        """``apply_fn()`` on the runs that reduced the gradients, nothing on the others."""
        with tf.control_dependencies([g for g in grads if g is not None]):
            applying = tf.equal(self.counter.read_value(), 0)
        return tf.cond(applying, apply_fn, tf.no_op)


class DistributedLegacyOptimizer(v1.train.Optimizer):
    """An optimizer that reduces gradients across ranks before the wrapped optimizer applies them."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=None, sparse_as_dense=False, op=None,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=None,
                 scale_local_gradients=True, backward_passes_per_step=1, average_aggregated_gradients=False):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        backward_passes_per_step = check_backward_passes_per_step(backward_passes_per_step)
        if backward_passes_per_step > 1 and tf.executing_eagerly():
            raise ValueError("backward_passes_per_step > 1 is not yet supported for tf.compat.v1.train optimizers "
                             "with eager mode; use a Keras optimizer")
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self._reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                        groups, process_set, scale_local_gradients)
        self._aggregation = None
        if backward_passes_per_step > 1:
            self._aggregation = _LocalAggregation(backward_passes_per_step, average_aggregated_gradients)

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not exchanged; divided by the set size when
        ``scale_local_gradients``)."""
        self._reducer.register_local_variable(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, the gradients reduced across ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = (list(column) for column in zip(*pairs))
        with tf.name_scope(f"{self._name}_Allreduce"):
            if self._aggregation is None:
                reduced = self._reducer(grads, variables)
            else:
                reduced = self._aggregation.gradients(grads, variables, self._reducer)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients`` (with ``backward_passes_per_step`` N > 1, on every
        N-th run only)."""
        pairs = list(grads_and_vars)
        if self._aggregation is None:
            return self._optimizer.apply_gradients(pairs, global_step, name)
        return self._aggregation.apply([g for g, _ in pairs],
                                       lambda: self._optimizer.apply_gradients(pairs, global_step, name))

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
