"""SyncBatchNormalization: Keras 3 batch normalization whose training statistics are those of the batch
concatenated over every rank, as Horovod's ``hvd.SyncBatchNormalization``.

While training, each rank computes its own count, mean and variance per channel (Keras' own moments, so a
mask is honoured), places them in its row of a ``[size, 3, channels]`` tensor and allreduces it (Sum): every
rank then holds every rank's statistics and combines them exactly (Chan et al.'s parallel formula), so
ranks may hold different numbers of samples. The allreduce is differentiable (its gradient is the Sum of
the ranks' gradients), so the backward pass is that of BatchNormalization on the concatenated batch for the
sum of the ranks' losses. The moving statistics are updated from the combined ones, so they stay equal on
every rank; inference uses them and exchanges nothing. Needs Keras' tensorflow backend.
"""

import keras
import tensorflow as tf

from rvod.common.basics import rank, size
from rvod.common.reduce_ops import Sum
from rvod.tensorflow.mpi_ops import allreduce


@keras.saving.register_keras_serializable(package="rvod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with statistics synchronized across all ranks while training.
    ``fused`` is Horovod's argument and must be False (Keras 3 has no fused kernel)."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if keras.backend.backend() != "tensorflow":
            raise ValueError(f"rvod.tensorflow.SyncBatchNormalization needs Keras' tensorflow backend, not "
                             f"{keras.backend.backend()!r}")
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        ranks = size()
        if ranks == 1:
            return mean, variance
        axes = list(self._reduction_axes)
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), mean.dtype) * tf.ones_like(mean)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), mean.dtype), tf.shape(inputs))
            count = tf.reshape(tf.reduce_sum(weights, axes), tf.shape(mean))
        # A rank without samples contributes zeros (its mean is NaN).
        mine = tf.stack([count, tf.math.multiply_no_nan(mean, count), tf.math.multiply_no_nan(variance, count)])
        row = tf.reshape(tf.one_hot(rank(), ranks, dtype=mean.dtype), [ranks] + [1] * len(mine.shape))
        everyone = allreduce(row * mine[tf.newaxis], op=Sum)
        counts, sums, squares = tf.unstack(everyone, axis=1)
        total = tf.reduce_sum(counts, 0)
        group_mean = tf.reduce_sum(sums, 0) / total
        rank_means = tf.math.divide_no_nan(sums, counts)
        spread = tf.reduce_sum(tf.math.multiply_no_nan(tf.square(rank_means - group_mean), counts), 0)
        return group_mean, (tf.reduce_sum(squares, 0) + spread) / total
