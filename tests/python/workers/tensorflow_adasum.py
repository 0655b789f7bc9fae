"""Adasum through TensorFlow's and Keras' DistributedOptimizer(op=Adasum) on 2 or 3 ranks (rvodrun), against
a NumPy reference: every rank's local SGD update of w under the loss sum((w - t_rank)^2) is
-2 lr (w - t_rank), and after a combining step every rank holds w + Adasum(updates).

Cases: rvod.keras allreduce and grouped_allreduce with op=Adasum (float16/32/64) against the reference;
TensorFlow 1 optimizers in a graph run by a Session (one step twice; backward_passes_per_step 2, where the
first run is local only) and eagerly (minimize); Keras 3 optimizers eagerly (apply) and with
backward_passes_per_step 2 (the accumulated gradients summed); on 3 ranks, Keras and TensorFlow 1 optimizers
and DistributedGradientTape on the process set of ranks 0 and 1 (rank 2 takes its local step alone, also
with Keras and op=Average, and the tape gives it its own gradient);
Keras model.fit on the digits data with op=Adasum reaching well above chance with the same weights on every
rank; refusals.
"""

import os

import keras
import numpy as np
import rvod.keras
import rvod.tensorflow as hvd
import tensorflow as tf
from _adasum_reference import reference
from _check import check, expect_error, finish

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
# Ranks 0 and 1, registered at init from 3 ranks on.
PAIR = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[PAIR] if int(os.environ["RVOD_SIZE"]) >= 3 else None)
R, N = hvd.rank(), hvd.size()
LR = 0.125  # exact in float32, the learning rate dtype of TensorFlow 1 and Keras optimizers
W0 = np.linspace(-1.0, 1.0, 6)


def target(rank):
    return np.random.default_rng([rank, 7]).standard_normal(6)


def local_steps(w, rank, steps=1):
    """Where rank's plain SGD takes w in ``steps`` steps."""
    for _ in range(steps):
        w = w - LR * 2 * (w - target(rank))
    return w


def combined(w, steps=1):
    """Every rank's value after a combining step that began at w."""
    return w + reference([local_steps(w, r, steps) - w for r in range(N)])


def data(rank, shape, dtype, salt):
    return np.random.default_rng([rank, salt]).standard_normal(shape).astype(dtype)


def same_on_every_rank(value):
    gathered = hvd.allgather(tf.constant(np.asarray(value, np.float64)[None]), name="adasum.same").numpy()
    assert all(np.array_equal(gathered[0], row) for row in gathered), gathered


with check("rvod.keras allreduce and grouped_allreduce with op=Adasum"):
    specs = [((4, 5), np.float32, 1e-6), ((7,), np.float64, 1e-12), ((3, 2), np.float16, 2e-3)]
    values = [keras.ops.convert_to_tensor(data(R, shape, dtype, salt)) for salt, (shape, dtype, _) in enumerate(specs)]
    wants = [reference([data(r, shape, dtype, salt) for r in range(N)]).reshape(shape)
             for salt, (shape, dtype, _) in enumerate(specs)]
    single = rvod.keras.allreduce(values[0], name="keras.adasum", op=rvod.keras.Adasum)
    assert isinstance(single, np.ndarray) and single.dtype == np.float32 and single.shape == (4, 5), single
    np.testing.assert_allclose(single, wants[0], rtol=1e-6, atol=1e-6)
    grouped = rvod.keras.grouped_allreduce(values, name="keras.adasum.grouped", op=rvod.keras.Adasum)
    assert isinstance(grouped, list) and len(grouped) == 3, grouped
    for got, want, (shape, dtype, tolerance) in zip(grouped, wants, specs):
        assert got.dtype == dtype and got.shape == shape, (got.dtype, got.shape)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(grouped[0], single)

# TensorFlow 1 optimizer, graph mode.
for steps in (1, 2):
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.Variable(W0, dtype=tf.float64, name="w")
        loss = tf.reduce_sum(tf.square(w - tf.constant(target(R))))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum,
                                       backward_passes_per_step=steps)
        train = opt.minimize(loss)
        init = [tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()]
    with tf.compat.v1.Session(graph=graph) as session:
        value = None
        session.run(init)
        with check(f"tf1 graph, backward_passes_per_step {steps}"):
            assert type(opt).__name__ == "DistributedAdasumLegacyOptimizer", type(opt)
            expected = W0
            for run in range(2 * steps):
                session.run(train)
                value = session.run(w)
                if (run + 1) % steps == 0:
                    expected = combined(expected, steps)
                    np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-12)
                else:
                    np.testing.assert_allclose(value, local_steps(expected, R, run % steps + 1), rtol=1e-12)
    with check(f"tf1 graph, backward_passes_per_step {steps}: the same on every rank"):
        same_on_every_rank(value)

# TensorFlow 1 optimizer, eagerly.
with check("tf1 eager minimize"):
    w = tf.Variable(W0, dtype=tf.float64)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum)
    for _ in range(2):
        opt.minimize(lambda: tf.reduce_sum(tf.square(w - target(R))), var_list=[w])
    np.testing.assert_allclose(w.numpy(), combined(combined(W0)), rtol=1e-12, atol=1e-12)
    same_on_every_rank(w.numpy())

# Keras 3 optimizer, eagerly.
for steps in (1, 2):
    with check(f"keras apply, backward_passes_per_step {steps}"):
        w = keras.Variable(W0, dtype="float64")
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Adasum, backward_passes_per_step=steps)
        assert type(opt).__name__ == "SGD" and opt.lr == opt.learning_rate
        start = W0
        for run in range(2 * steps):
            opt.apply([tf.constant(2 * (start - target(R)))], [w])
            if (run + 1) % steps == 0:
                # The accumulated gradients are summed (Horovod's default), so the local step is steps x one.
                start = start + reference([-LR * steps * 2 * (start - target(r)) for r in range(N)])
                np.testing.assert_allclose(w.numpy(), start, rtol=1e-12, atol=1e-12)
            else:
                np.testing.assert_allclose(w.numpy(), start)
        same_on_every_rank(w.numpy())

# Optimizers on the process set of ranks 0 and 1 (3 ranks): ranks 0 and 1 combine their updates, rank 2 only
# takes its local step.
if N >= 3:
    paired = W0 + reference([local_steps(W0, r) - W0 for r in (0, 1)]) if R < 2 else local_steps(W0, R)
    with check("keras apply on the process set of ranks 0 and 1"):
        w = keras.Variable(W0, dtype="float64")
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Adasum, process_set=PAIR)
        opt.apply([tf.constant(2 * (W0 - target(R)))], [w])
        np.testing.assert_allclose(w.numpy(), paired, rtol=1e-12, atol=1e-12)
    with check("keras Average on the process set of ranks 0 and 1: rank 2 keeps its own gradient"):
        w = keras.Variable(W0, dtype="float64")
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Average, process_set=PAIR)
        opt.apply([tf.constant(2 * (W0 - target(R)))], [w])
        ranks = (0, 1) if R < 2 else (R,)
        averaged = np.mean([2 * (W0 - target(r)) for r in ranks], axis=0)
        np.testing.assert_allclose(w.numpy(), W0 - LR * averaged, rtol=1e-12, atol=1e-12)
    with check("tf1 eager minimize on the process set of ranks 0 and 1"):
        w = tf.Variable(W0, dtype=tf.float64)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum,
                                       process_set=PAIR)
        opt.minimize(lambda: tf.reduce_sum(tf.square(w - target(R))), var_list=[w])
        np.testing.assert_allclose(w.numpy(), paired, rtol=1e-12, atol=1e-12)

    with check("DistributedGradientTape(op=Adasum) on the process set of ranks 0 and 1"):
        w = tf.Variable(W0, dtype=tf.float64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(w - target(R)))
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, process_set=PAIR)
        (gradient,) = tape.gradient(loss, [w])
        gradients = [2 * (W0 - target(r)) for r in ((0, 1) if R < 2 else (R,))]
        np.testing.assert_allclose(gradient.numpy(), reference(gradients), rtol=1e-12, atol=1e-12)

# Keras 3 model.fit on the digits data.
with check("keras fit on digits"):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    shard = slice(R, 1500, N)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    callbacks = [rvod.keras.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(x[shard], y[shard], batch_size=32, epochs=8, callbacks=callbacks, verbose=0)
    accuracy = model.evaluate(x[1500:], y[1500:], verbose=0)[1]
    assert accuracy > 0.8, accuracy
    for layer_weights in model.get_weights():
        same_on_every_rank(layer_weights.ravel())

with check("refusals"):
    expect_error(ValueError, "gradient_predivide_factor not supported with op != Average",
                 hvd.DistributedOptimizer, keras.optimizers.SGD(0.1), op=hvd.Adasum, gradient_predivide_factor=2.0)

print(f"rank {R}: pid {os.getpid()}", flush=True)
finish(R)
