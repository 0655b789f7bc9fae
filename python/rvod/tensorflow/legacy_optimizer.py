"""DistributedOptimizer for TensorFlow 1 optimizers (``tf.compat.v1.train.Optimizer``), as Horovod's.

The wrapper is itself a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` asks the wrapped optimizer
for its gradients and reduces them across ranks (one grouped allreduce per group, so in a graph that is
one node; ``tf.IndexedSlices`` gathered unless ``sparse_as_dense``; registered local variables kept
local); ``apply_gradients``, ``get_slot``, ``get_slot_names`` and ``variables`` are the wrapped
optimizer's, so ``minimize`` works too. Works in tf.compat.v1 graphs run by a Session and eagerly.
"""

import tensorflow as tf

from rvod.tensorflow.gradients import GradientReducer


class DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """An optimizer that reduces gradients across ranks before the wrapped optimizer applies them."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=None, sparse_as_dense=False, op=None,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=None,
                 scale_local_gradients=True):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self._reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                        groups, process_set, scale_local_gradients)

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not exchanged; divided by the set size when
        ``scale_local_gradients``)."""
        self._reducer.register_local_variable(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, the gradients reduced across ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        with tf.name_scope(f"{self._name}_Allreduce"):
            reduced = self._reducer(list(grads), list(variables))
        return list(zip(reduced, variables))

    def apply_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
