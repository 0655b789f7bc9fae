"""rvod.keras DistributedOptimizer(sharded=True), run by rvodrun with 2 ranks: model.fit with a sharded Adam
for 60 steps gives the parameters of model.fit with the plain DistributedOptimizer (both in this job, in
Keras' tf.function); each rank's optimizer variables hold 1/2 of the plain one's slots; eagerly, with
op=Sum and gradient_predivide_factor; rvod.tensorflow's DistributedOptimizer takes sharded=True;
backward_passes_per_step=2 as unsharded; refusals. Checkpoints: a state_dict() round trip, a consolidated
state that a plain Adam loads and trains on as the sharded one does; model.save() refused until
consolidate_state_dict(to=0), then saving the whole state that keras.models.load_model and
hvd.load_model(sharded=True) load. With a directory argument, rank r writes
its state_dict() there (sharded_r.pkl), rank 0 the consolidated state and the model's weights
(checkpoint.pkl), for workers/keras_sharded_reshard.py.
"""

import os
import pickle
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.keras as hvd
import rvod.tensorflow
from rvod.common.objects import broadcast_object

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

with check("backward_passes_per_step=2 (Adam, SGD with momentum, eagerly) equals the unsharded optimizer's"):
    for make, eager, tolerance in ((lambda: keras.optimizers.Adam(0.01), False, 2e-5),
                                   (lambda: keras.optimizers.SGD(0.01, momentum=0.9), True, 2e-6)):
        sharded = trained(hvd.DistributedOptimizer(make(), sharded=True, backward_passes_per_step=2), steps=20,
                          run_eagerly=eager)
        plain = trained(hvd.DistributedOptimizer(make(), backward_passes_per_step=2), steps=20)
        difference = max_difference(sharded, plain)
        assert difference < tolerance, f"parameters differ by {difference}"
        assert int(sharded.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 10


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def go_on(model, start, steps=5):
    """Train ``model`` on the next ``steps`` batches from batch ``start``."""
    model.fit(X[start * BATCH:(start + steps) * BATCH], Y[start * BATCH:(start + steps) * BATCH], batch_size=BATCH,
              epochs=1, shuffle=False, verbose=0)
    return model


with check("checkpoint: state_dict() is this rank's slice; loaded back, training goes on exactly as before"):
    model = trained(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), sharded=True), steps=10)
    optimizer, weights = model.optimizer, model.get_weights()
    state = optimizer.state_dict()
    assert sum(v.size for shard in state["shards"] for v in shard.values()) == slot_elements(optimizer)
    whole = optimizer.consolidate_state_dict(to=None)
    after = [w.copy() for w in go_on(model, 10).get_weights()]
    model.set_weights(weights)
    optimizer.load_state_dict(state)
    again = go_on(model, 10).get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(after, again)), "training from the loaded state differs"

with check("consolidated: a plain Adam loads it (set_weights) and trains on as the sharded optimizer does"):
    plain = keras.optimizers.Adam(0.01)
    fresh = make_model()
    plain.build(fresh.trainable_variables)
    plain.set_weights(whole)
    assert int(plain.iterations.numpy()) == 10
    assert sum(int(np.prod(v.shape)) for v in plain.variables if len(v.shape) > 0) == 2 * TOTAL
    distributed = make_model()
    distributed.set_weights(weights)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    optimizer.build(distributed.trainable_variables)
    optimizer.set_weights(whole)
    distributed.compile(optimizer=optimizer, loss="mse")
    difference = max_difference(go_on(distributed, 10), model)
    assert difference < 1e-6, f"parameters differ by {difference}"
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], f"sharded_{R}.pkl"), "wb") as file:
            pickle.dump(state, file)
        if R == 0:
            with open(os.path.join(sys.argv[1], "checkpoint.pkl"), "wb") as file:
                pickle.dump({"whole": whole, "weights": weights}, file)

with check("model.save(): refused, naming consolidate_state_dict(), until it was called; then a plain load_model "
           "and hvd.load_model(sharded=True) get the whole state"):
    directory = sys.argv[1] if len(sys.argv) > 1 else broadcast_object(tempfile.mkdtemp(), 0, name="keras.tmp")
    path = os.path.join(directory, "model.keras")
    expect_error(ValueError, rf"model.save\(\) with a sharded optimizer on {N} ranks: rank {R} holds its slice of the "
                 r"optimizer state only. Call optimizer.consolidate_state_dict\(to=R\) on every rank",
                 model.save, os.path.join(directory, f"refused_{R}.keras"))
    whole = model.optimizer.consolidate_state_dict(to=0)
    if R == 0:
        model.save(path)
    rvod.tensorflow.barrier()
    loaded = hvd.load_model(path, sharded=True)
    assert same(loaded.optimizer.consolidate_state_dict(to=None), model.optimizer.consolidate_state_dict(to=None))
    assert same(loaded.get_weights(), model.get_weights())
    plain = keras.models.load_model(path)
    if R == 0:
        assert same([keras.ops.convert_to_numpy(v) for v in plain.optimizer.variables], whole)
    expect_error(ValueError, r"Call optimizer.consolidate_state_dict\(to=R\)", go_on(model, 15, 1).save, path)


with check("refusals: Adasum, clipnorm, global_clipnorm, use_ema, a tf.compat.v1 optimizer"):
    expect_error(ValueError, r"sharded=True does not take op=Adasum: Adasum combines whole parameter updates",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(), op=hvd.Adasum, sharded=True)
    expect_error(ValueError, r"sharded=True cannot take clipnorm: it needs the norm of whole gradients",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(clipnorm=1.0), sharded=True)
    expect_error(ValueError, r"sharded=True cannot take global_clipnorm",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(global_clipnorm=1.0), sharded=True)
    expect_error(ValueError, r"sharded=True cannot take use_ema",
                 hvd.DistributedOptimizer, keras.optimizers.Adam(use_ema=True), sharded=True)
    expect_error(ValueError, r"sharded=True cannot shard Adafactor: it factors its state",
                 hvd.DistributedOptimizer, keras.optimizers.Adafactor(), sharded=True)
    expect_error(ValueError, r"load_state_dict\(\) needs the sharded optimizer built",
                 hvd.DistributedOptimizer(keras.optimizers.Adam(), sharded=True).load_state_dict, state)
    expect_error(ValueError, r"sharded=True takes a Keras 3 optimizer",
                 rvod.tensorflow.DistributedOptimizer, tf.compat.v1.train.GradientDescentOptimizer(0.1), sharded=True)

finish(R)
