"""Reducing a list of TensorFlow gradients across ranks: what ``DistributedGradientTape`` and the Keras
``DistributedOptimizer`` (TensorFlow backend) share. The logic is ``rvod.common.gradients``'; here are
TensorFlow's tensors: ``tf.IndexedSlices`` are gathered (``allreduce``'s sparse path) unless
``sparse_as_dense``, and variables are keyed by ``ref()`` (a Keras 3 variable by its ``tf.Variable``'s, so
either may name it)."""

import tensorflow as tf

from rvod.common import gradients as _gradients
from rvod.tensorflow.mpi_ops import allreduce, grouped_allreduce


class GradientReducer(_gradients.GradientReducer):
    @staticmethod
    def variable_key(variable):
        # A Keras 3 variable is not a tf.Variable and has no ref(); under the tensorflow backend it wraps one.
        wrapped = getattr(variable, "_value", None)
        if isinstance(wrapped, tf.Variable):
            variable = wrapped
        return variable.ref() if isinstance(variable, tf.Variable) else id(variable)

    def is_sparse(self, grad):
        return isinstance(grad, tf.IndexedSlices)

    def densify(self, grad):
        return tf.convert_to_tensor(grad)

    def divide(self, grad, count):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / count, grad.indices, grad.dense_shape)
        return grad / count

    def reduce_sparse(self, grad, op, process_set):
        return allreduce(grad, op=op, process_set=process_set)

    def grouped_allreduce(self, grads, compression, op, prescale_factor, postscale_factor, process_set):
        return grouped_allreduce(grads, compression=compression, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set)
