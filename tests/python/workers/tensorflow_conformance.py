"""TensorFlow/Keras pieces of Horovod that scripts rely on, checked as a Horovod user would (2 ranks, eager):
hvd.SyncBatchNormalization against keras BatchNormalization on the batch concatenated over the ranks
(forward, backward, moving statistics, inference; ranks with different batch sizes), PartialDistributedGradientTape
with Keras 3 variables, the Keras 2 spellings on rvod's DistributedOptimizer (a script in the style of Horovod's
Keras synthetic benchmark), and a tf.compat.v1 graph built while eager execution is on.
"""

import keras
import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.tensorflow as hvd
import rvod.tensorflow.keras as hvd_keras

hvd.init()
R, N = hvd.rank(), hvd.size()
assert N >= 2, "run with at least 2 ranks"


def batch(rank):
    """Rank ``rank``'s inputs: rank + 2 samples of 4 x 3 (channels last), and a loss weight per value."""
    rng = np.random.default_rng(100 + rank)
    x = rng.normal(loc=3.0, scale=2.0, size=[rank + 2, 4, 3]).astype(np.float32)
    w = rng.normal(size=[rank + 2, 4, 3]).astype(np.float32)
    return x, w


def mine(array):
    """This rank's rows of an array over the concatenated batch."""
    start = sum(r + 2 for r in range(R))
    return array[start:start + R + 2]


def close(got, expected, label, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=rtol, atol=atol, err_msg=label)


# ------------------------------------------------------------------------------- SyncBatchNormalization

OPTIONS = {"momentum": 0.8, "epsilon": 1e-3, "beta_initializer": keras.initializers.Constant(0.5),
           "gamma_initializer": keras.initializers.Constant(1.5)}
x_all = np.concatenate([batch(r)[0] for r in range(N)])
w_all = np.concatenate([batch(r)[1] for r in range(N)])
x_mine, w_mine = batch(R)

with check("SyncBatchNormalization forward and backward while training = BatchNormalization on the concatenated "
           "batch"):
    sync = hvd.SyncBatchNormalization(**OPTIONS)
    reference = keras.layers.BatchNormalization(**OPTIONS)
    assert isinstance(sync, keras.layers.BatchNormalization)
    x, xs = tf.constant(x_mine), tf.constant(x_all)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        tape.watch(xs)
        y = sync(x, training=True)
        loss = tf.reduce_sum(y * w_mine)
        y_ref = reference(xs, training=True)
        loss_ref = tf.reduce_sum(y_ref * w_all)
    close(y, mine(y_ref.numpy()), "forward")
    alone = keras.layers.BatchNormalization(**OPTIONS)(x, training=True)
    assert not np.allclose(alone, y, rtol=1e-3, atol=1e-3), "this rank's statistics alone give the same result"
    close(tape.gradient(loss, x), mine(tape.gradient(loss_ref, xs).numpy()), "input gradient")
    # gamma and beta: each rank's gradient covers its own samples; their sum is the reference's.
    for name, (local, ref) in {"gamma": (sync.gamma, reference.gamma), "beta": (sync.beta, reference.beta)}.items():
        total = hvd.allreduce(tape.gradient(loss, local), op=hvd.Sum)
        close(total, tape.gradient(loss_ref, ref), f"{name} gradient summed over ranks", rtol=1e-4, atol=1e-4)
    close(sync.moving_mean, reference.moving_mean, "moving mean")
    close(sync.moving_variance, reference.moving_variance, "moving variance")

with check("SyncBatchNormalization in inference uses the moving statistics, the same on every rank"):
    close(sync(x, training=False), mine(reference(xs, training=False).numpy()), "inference")
    everyone = hvd.allgather_object(sync.moving_variance.numpy())
    assert all(np.array_equal(v, everyone[0]) for v in everyone), "moving statistics differ between ranks"

with check("SyncBatchNormalization inside tf.function and in a Keras model trained with model.fit"):
    traced = tf.function(lambda t: sync(t, training=True))
    reference_again = reference(xs, training=True)
    close(traced(x), mine(reference_again.numpy()), "traced forward")
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Conv1D(2, 1), hvd.SyncBatchNormalization(),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    hvd_keras.broadcast_global_variables(0, model)
    model.fit(x_mine, np.ones([R + 2, 1], np.float32), batch_size=R + 2, epochs=2, verbose=0)
    weights = hvd.allgather_object([v.numpy() for v in model.variables])
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

with check("SyncBatchNormalization(fused=True) is refused as in Horovod"):
    expect_error(ValueError, "does not support fused=True", hvd.SyncBatchNormalization, fused=True)
    expect_error(ValueError, "does not support fused=True", hvd.SyncBatchNormalization, fused=None)


# --------------------------------------------------------------------- PartialDistributedGradientTape

def two_layer_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones"),
                              keras.layers.Dense(1, kernel_initializer="ones")])
    return model, model.layers[0], model.layers[1]


with check("PartialDistributedGradientTape with Keras 3 layers: local layers' gradients stay local"):
    model, shared, local = two_layer_model()
    assert not isinstance(local.kernel, tf.Variable), "Keras 3 variables are expected here"
    inputs = tf.fill([2, 3], float(R + 1))
    with tf.GradientTape() as plain:
        loss = tf.reduce_sum(model(inputs))
    with tf.GradientTape() as reference_tape:
        reference_loss = tf.reduce_sum(model(inputs))
    tape = hvd.PartialDistributedGradientTape(plain, local_layers=[local])
    grads = tape.gradient(loss, model.trainable_variables)
    local_grads = reference_tape.gradient(reference_loss, model.trainable_variables)
    averaged = [hvd.allreduce(g, op=hvd.Average) for g in local_grads]
    for i, variable in enumerate(model.trainable_variables):
        is_local = any(variable is w for w in local.trainable_weights)
        expected = local_grads[i] / N if is_local else averaged[i]
        close(grads[i], expected, f"{variable.path} ({'local' if is_local else 'shared'})")
    assert not np.allclose(local_grads[2], averaged[2]), "the local layer's gradient should differ across ranks"

with check("PartialDistributedGradientTape: one layer, the tf.Variable of a Keras variable names it too, errors"):
    model, shared, local = two_layer_model()
    inputs = tf.fill([2, 3], float(R + 1))
    with tf.GradientTape() as plain:
        loss = tf.reduce_sum(model(inputs))
    tape = hvd.PartialDistributedGradientTape(plain, local_layers=local, scale_local_gradients=False)
    tape.register_local_source(shared.bias.value)  # the tf.Variable inside the Keras variable
    with tf.GradientTape() as reference_tape:
        reference_loss = tf.reduce_sum(model(inputs))
    grads = tape.gradient(loss, model.trainable_variables)
    reference_grads = reference_tape.gradient(reference_loss, model.trainable_variables)
    close(grads[1], reference_grads[1], "shared bias registered through its tf.Variable stays local")
    close(grads[3], reference_grads[3], "local bias, unscaled")
    close(grads[0], hvd.allreduce(reference_grads[0]), "shared kernel averaged")
    expect_error(ValueError, "must be of tf.keras.layers.Layer type", hvd.PartialDistributedGradientTape,
                 tf.GradientTape(), local_layers=[object()])

with check("Keras DistributedOptimizer.register_local_var with a Keras 3 variable"):
    model, shared, local = two_layer_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    optimizer.register_local_var(local.bias)
    inputs = tf.fill([2, 3], float(R + 1))
    with tf.GradientTape() as plain:
        loss = tf.reduce_sum(model(inputs))
    grads = plain.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    close(local.bias, -grads[3] / N, "local bias stepped by its own gradient / size")
    close(shared.bias, -hvd.allreduce(grads[1]), "shared bias stepped by the averaged gradient")


# ------------------------------------------------------------------------------- Keras 2 spellings

with check("Keras 2 spelling on rvod's DistributedOptimizer: opt.variables(), opt.lr; not an optimizer: "
           "ValueError"):
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones([4, 3]), np.ones([4, 1]), verbose=0)
    assert opt.variables() == opt.variables and len(opt.variables()) == len(opt.variables) > 0
    assert abs(float(opt.lr) - 0.01) < 1e-7
    opt.lr = 0.02
    assert abs(float(opt.learning_rate) - 0.02) < 1e-7
    expect_error(ValueError, "Keras optimizer", hvd.DistributedOptimizer, object())
    expect_error(TypeError, "Keras optimizer", hvd.DistributedOptimizer, object())

with check("a script in the style of Horovod's Keras synthetic benchmark, with the README's Keras 3 changes"):
    # Horovod's example, as a Keras 2 script spells it; the two changes the README lists are marked.
    keras.utils.set_random_seed(1000 + R)  # different initial weights on every rank
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    opt = tf.optimizers.SGD(0.01)
    data = tf.random.uniform([16, 8], seed=R)
    target = tf.random.uniform([16, 1], minval=0, maxval=4, dtype=tf.int64, seed=R)
    dataset = tf.data.Dataset.from_tensor_slices((data, target)).cache().repeat().batch(8)
    opt = hvd_keras.DistributedOptimizer(opt, compression=hvd_keras.Compression.fp16)
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt)  # change 1
    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), hvd_keras.callbacks.MetricAverageCallback()]
    history = model.fit(dataset, steps_per_epoch=3, callbacks=callbacks, epochs=2, verbose=0)
    hvd.broadcast_variables(opt.variables(), root_rank=0)  # Keras 2's call, on rvod's optimizer
    weights = hvd.allgather_object([v.numpy() for v in model.variables])
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    losses = hvd.allgather_object(history.history["loss"])
    assert all(np.allclose(losses[0], other) for other in losses), losses


# ------------------------------------------------------------------------------ control flow in tf.function

with check("unnamed collectives inside tf.cond and tf.while_loop in a tf.function match across ranks"):
    if R == 1:  # moves TensorFlow's process-wide ids on one rank only
        tf.function(lambda: tf.cond(tf.constant(True), lambda: tf.constant(1), lambda: tf.constant(2)))()

    @tf.function
    def branches(value):
        summed = tf.cond(value > 0, lambda: hvd.allreduce(value, op=hvd.Sum), lambda: value)
        return tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, hvd.allreduce(v, op=hvd.Sum)),
                             (tf.constant(0), summed))[1]

    close(branches(tf.constant(float(R + 1))), sum(r + 1 for r in range(N)) * N * N, "cond then two loop steps")


with check("broadcast_object and allgather_object refuse to run inside a tf.function"):
    expect_error(RuntimeError, "outside tf.function", tf.function(lambda: hvd.broadcast_object(1)))
    expect_error(RuntimeError, "outside tf.function", tf.function(lambda: hvd.allgather_object(1)))


# ---------------------------------------------------- a tf.compat.v1 graph while eager execution is on

with check("a tf.compat.v1 graph built in an eager program: ops run by a Session, 32 of them in one run"):
    with tf.Graph().as_default():
        summed = hvd.allreduce(tf.constant([1.0, 2.0]) * (R + 1), op=hvd.Sum)
        gathered = hvd.allgather(tf.fill([R + 1], R))
        many = [hvd.allreduce(tf.fill([3], float(i + R)), op=hvd.Sum) for i in range(32)]
        with tf.compat.v1.Session() as session:
            got_sum = session.run(summed)
            got_gathered = session.run(gathered)
            got_many = session.run(many)
    close(got_sum, np.array([1.0, 2.0]) * sum(r + 1 for r in range(N)), "allreduce")
    assert got_gathered.tolist() == [r for r in range(N) for _ in range(r + 1)], got_gathered
    for i, got in enumerate(got_many):
        close(got, np.full(3, sum(float(i + r) for r in range(N))), f"allreduce {i} of 32")

hvd.shutdown()
finish(R)
