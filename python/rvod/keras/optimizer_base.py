"""What both of rvod.keras' optimizer mix-ins share: Keras 2's spellings on a Keras 3 optimizer
(``opt.variables()``, ``opt.lr``), and the refusal to run inside XLA.
"""

import keras


class _CallableList(list):
    """A list that returns itself when called: Keras 2's ``optimizer.variables()`` and Keras 3's
    ``optimizer.variables`` both work."""

    def __call__(self):
        return self


class KerasSpellings:
    """Keras 2's spellings on a Keras 3 optimizer (see the module docstring)."""

    @property
    def variables(self):
        return _CallableList(super().variables)

    @property
    def lr(self):
        """Keras 2's name of ``learning_rate``."""
        return self.learning_rate

    @lr.setter
    def lr(self, value):
        self.learning_rate = value


def refuse_xla():
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError("rvod's DistributedOptimizer cannot run inside XLA: compile the model with "
                         "jit_compile=False")
