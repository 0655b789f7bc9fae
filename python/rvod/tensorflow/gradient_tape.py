"""DistributedGradientTape: a ``tf.GradientTape`` whose ``gradient()`` returns gradients reduced across ranks.

The object returned is an instance of a subclass of the wrapped tape's class with the same name, sharing
the wrapped tape's recorded state, so it can be made before or after the ``with`` block. Works eagerly and
inside ``tf.function``.
"""

import tensorflow as tf

from rvod.common.gradients import refuse_rewrapping
from rvod.common.process_sets import global_process_set
from rvod.common.reduce_ops import Average
from rvod.tensorflow.compression import Compression
from rvod.tensorflow.gradients import GradientReducer


class _DistributedGradientTape:
    """Mixed in before the wrapped tape's class; see the module docstring."""

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The gradients of ``target`` with respect to ``sources``, reduced across ranks (``use_generic_names``
        is Horovod's and has no effect: names are given automatically)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, self._rvod_reducer(flat_grads, flat_sources))

    def register_local_source(self, source):
        """Keep ``source``'s gradient local (not exchanged; divided by the set size when
        ``scale_local_gradients``)."""
        self._rvod_reducer.register_local_variable(source)


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wrap ``gradtape`` so that ``gradient()`` averages (``op``) gradients across ``process_set``.
    Arguments are Horovod's; ``device_dense``/``device_sparse`` are ignored (rvod.tensorflow reduces tensors in
    host memory)."""
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    refuse_rewrapping(gradtape, _DistributedGradientTape, what="tape", wrapper="DistributedGradientTape")
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
                              process_set, scale_local_gradients, allow_adasum=True)
    cls = type(type(gradtape).__name__, (_DistributedGradientTape, type(gradtape)), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(vars(gradtape))
    tape._rvod_reducer = reducer
    return tape


def PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape that keeps the gradients of ``local_layers``' trainable weights local
    (Keras layers; their weights may be Keras 3 variables)."""
    import keras

    if local_layers is None:
        layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        layers = [local_layers]
    else:
        layers = list(local_layers)
        if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
            raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape
