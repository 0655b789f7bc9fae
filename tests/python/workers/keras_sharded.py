"""rvod.keras DistributedOptimizer(sharded=True), run by rvodrun with 2 ranks: model.fit with a sharded Adam
for 60 steps gives the parameters of model.fit with the plain DistributedOptimizer (both in this job, in
Keras' tf.function); each rank's optimizer variables hold 1/2 of the plain one's slots; eagerly, with
op=Sum and gradient_predivide_factor; rvod.tensorflow's DistributedOptimizer takes sharded=True; refusals.
"""

import keras
import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.keras as hvd
import rvod.tensorflow

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
R, N = hvd.rank(), hvd.size()
BATCH, STEPS = 4, 60

rng = np.random.default_rng(R)
X = rng.normal(size=(BATCH * STEPS, 5)).astype(np.float32)
Y = rng.normal(size=(BATCH * STEPS, 3)).astype(np.float32)


def make_model():
    """Odd sizes (uneven chunks) and a bias of 3 elements."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])


def trained(optimizer, steps=STEPS, run_eagerly=False):
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    model.fit(X[:steps * BATCH], Y[:steps * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def max_difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a.get_weights(), b.get_weights()))


def slot_elements(optimizer):
    """Elements of the optimizer's own variables other than its counters (Adam: the two moments)."""
    return sum(int(np.prod(v.shape)) for v in optimizer.variables if len(v.shape) > 0)


TOTAL = 5 * 7 + 7 + 7 * 3 + 3

with check(f"Adam, model.fit: {STEPS} steps sharded equal the plain DistributedOptimizer's, the same on every rank"):
    sharded_optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), sharded=True)
    sharded = trained(sharded_optimizer)
    plain_optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    plain = trained(plain_optimizer)
    difference = max_difference(sharded, plain)
    assert difference < 2e-5, f"parameters differ by {difference}"
    weights = sharded.get_weights()
    for value in weights:
        root = hvd.broadcast(value, root_rank=0)
        assert np.array_equal(root, value), "a parameter differs from rank 0's"

with check(f"the sharded Adam's moments here are 1/{N} of the plain one's"):
    mine, whole = slot_elements(sharded_optimizer), slot_elements(plain_optimizer)
    assert whole == 2 * TOTAL, (whole, TOTAL)
    assert mine <= 2 * (TOTAL // N + 4), f"{mine} elements of moments here, the plain one {whole}"
    total = int(hvd.allreduce(np.array(mine), op=hvd.Sum, name="keras.sharded.state"))
    assert total == whole, f"the ranks hold {total} elements together, the plain one {whole}"

with check("eagerly, with op=Sum; gradient_predivide_factor; rvod.tensorflow's DistributedOptimizer"):
    for options in (dict(op=hvd.Sum), dict(gradient_predivide_factor=2.0)):
        sharded = trained(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), sharded=True,
                                                   **options), steps=10, run_eagerly=True)
        plain = trained(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), **options), steps=10)
        assert max_difference(sharded, plain) < 2e-6, options
    sharded = trained(rvod.tensorflow.DistributedOptimizer(keras.optimizers.Adam(0.01), sharded=True), steps=10)
    plain = trained(rvod.tensorflow.DistributedOptimizer(keras.optimizers.Adam(0.01)), steps=10)
    assert max_difference(sharded, plain) < 2e-6

with check("refusals: Adasum, clipnorm, global_clipnorm, use_ema, a tf.compat.v1 optimizer"):
    expect_error(ValueError, r"sharded=True does not take op=Adasum: Adasum combines whole parameter updates",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(), op=hvd.Adasum, sharded=True)
    expect_error(ValueError, r"sharded=True cannot take clipnorm: it needs the norm of whole gradients",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(clipnorm=1.0), sharded=True)
    expect_error(ValueError, r"sharded=True cannot take global_clipnorm",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(global_clipnorm=1.0), sharded=True)
    expect_error(ValueError, r"sharded=True cannot take use_ema",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(use_ema=True), sharded=True)
    expect_error(ValueError, r"sharded=True takes a Keras 3 optimizer",
                 rvod.tensorflow.DistributedOptimizer, tf.compat.v1.train.GradientDescentOptimizer(0.1), sharded=True)

finish(R)
