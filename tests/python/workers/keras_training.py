"""rvod.keras training, run by rvodrun with 2 ranks: model.fit with DistributedOptimizer and the callbacks
against one process training on the full batch (the reference runs inside every rank, with no collective);
the callbacks' effects (initial broadcast, averaged metrics, warm-up and schedule values); gradient
aggregation (backward_passes_per_step); run_eagerly; load_model; the value helpers; argument errors.
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.keras as hvd
import rvod.numpy as hnp
import rvod.tensorflow
import rvod.tensorflow.keras
from rvod.keras.optimizer import _DistributedOptimizer

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
R, N = hvd.rank(), hvd.size()
BATCH, STEPS, EPOCHS, LR = 8, 4, 3, 0.1

rng = np.random.default_rng(0)
X_ALL = rng.normal(size=(N * BATCH * STEPS, 6)).astype(np.float32)
Y_ALL = rng.integers(0, 3, size=N * BATCH * STEPS)


def shard(array):
    """This rank's rows: the r-th BATCH rows of every global batch of N * BATCH rows."""
    return np.concatenate([array[k * N * BATCH + R * BATCH:k * N * BATCH + (R + 1) * BATCH] for k in range(STEPS)])


X, Y = shard(X_ALL), shard(Y_ALL)


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def compile_model(model, optimizer, run_eagerly=False):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], run_eagerly=run_eagerly)


class Recorder(keras.callbacks.Callback):
    """Weights after every epoch, logs as this callback sees them, learning rate before every batch."""

    def __init__(self):
        super().__init__()
        self.weights, self.logs, self.rates = [], [], []

    def on_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])
        self.logs.append(dict(logs))


def same_on_every_rank(arrays, label):
    for i, array in enumerate(arrays):
        reference = hnp.broadcast(np.ascontiguousarray(array), root_rank=0, name=f"same.{label}.{i}")
        assert np.array_equal(reference, array), f"{label}: array {i} differs from rank 0's"


def max_difference(first, second):
    return max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(first, second))


def reference_fit(initial, optimizer, callbacks=(), epochs=EPOCHS):
    """One process, the full batch of N * BATCH rows per step, no collective."""
    model = make_model(0)
    model.set_weights(initial)
    compile_model(model, optimizer)
    recorder = Recorder()
    model.fit(X_ALL, Y_ALL, batch_size=N * BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[*callbacks, recorder])
    return recorder


# ----------------------------------------------------------------- fit with every callback vs. reference

model = make_model(100 + R)  # different on purpose: the broadcast callback aligns the ranks
before = model.get_weights()
initial = [hnp.broadcast(w, root_rank=0, name=f"initial.{i}") for i, w in enumerate(model.get_weights())]
compile_model(model, hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)))
raw, recorder = Recorder(), Recorder()
warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=2, momentum_correction=False)
history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                               hvd.callbacks.MetricAverageCallback(), warmup, recorder])
reference = reference_fit(initial, keras.optimizers.SGD(LR, momentum=0.9), [
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=2, momentum_correction=False)])

with check("fit: weights identical on every rank after every epoch"):
    assert len(recorder.weights) == EPOCHS
    for epoch, weights in enumerate(recorder.weights):
        same_on_every_rank(weights, f"fit.epoch{epoch}")

with check("fit: weights equal to one process training on the full batch, after every epoch"):
    for epoch, (weights, expected) in enumerate(zip(recorder.weights, reference.weights)):
        difference = max_difference(weights, expected)
        assert difference < 1e-5, f"epoch {epoch}: max difference {difference}"
    assert R == 0 or max_difference(before, initial) > 0.01, "the test needs the ranks to start apart"

with check("MetricAverageCallback: every logged metric is the mean over the ranks, the same everywhere"):
    for epoch in range(EPOCHS):
        for key in ("loss", "accuracy"):
            gathered = hnp.allgather(np.array([raw.logs[epoch][key]]), name=f"raw.{epoch}.{key}")
            averaged = history.history[key][epoch]
            assert abs(averaged - gathered.mean()) < 1e-6, (key, epoch, averaged, gathered)
            same_on_every_rank([np.array([averaged])], f"metric.{epoch}.{key}")
    assert history.history["lr"] == [recorder.logs[e]["lr"] for e in range(EPOCHS)]

with check("LearningRateWarmupCallback: the rate before every batch follows the warm-up from lr/size to lr"):
    expected = []
    for epoch in range(EPOCHS):
        for batch in range(STEPS):
            if epoch < 2:
                progress = epoch + (batch + 1) / STEPS
                expected.append(LR / N * (progress * (N - 1) / 2 + 1))
            else:
                expected.append(LR)
    assert np.allclose(recorder.rates, expected, rtol=1e-6), (recorder.rates, expected)
    assert np.allclose(reference.rates, expected, rtol=1e-6)
    assert abs(history.history["lr"][-1] - LR) < 1e-7

with check("LearningRateScheduleCallback: staircase powers and a per-batch multiplier"):
    probe = make_model(1)
    compile_model(probe, keras.optimizers.SGD(1.0))
    staircase = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.8, multiplier=0.5, start_epoch=1, end_epoch=3)
    smooth = hvd.callbacks.LearningRateScheduleCallback(initial_lr=1.0, multiplier=lambda e: e + 1, staircase=False,
                                                        momentum_correction=False)
    rates = {}
    for label, callback in [("staircase", staircase), ("smooth", smooth)]:
        callback.set_model(probe)
        callback.set_params({"steps": 4, "epochs": 4})
        callback.on_train_begin()
        rates[label] = []
        for epoch in range(4):
            callback.on_epoch_begin(epoch)
            for batch in range(4):
                callback.on_batch_begin(batch)
                rates[label].append(float(keras.ops.convert_to_numpy(probe.optimizer.learning_rate)))
                callback.on_batch_end(batch)
    assert np.allclose(rates["staircase"], [1.0] * 4 + [0.8] * 4 + [0.4] * 4 + [0.4] * 4), rates["staircase"]
    assert np.allclose(rates["smooth"], [e + b / 4 + 1 for e in range(4) for b in range(4)]), rates["smooth"]
    expect_error(ValueError, "initial_lr", hvd.callbacks.LearningRateScheduleCallback, None, 0.5)
    unknown = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1)
    unknown.set_model(probe)
    unknown.set_params({"epochs": 1})
    expect_error(ValueError, "steps_per_epoch", unknown.on_train_begin)


# ------------------------------------------------------------------ gradient aggregation, eager, Sum

with check("backward_passes_per_step=2: local sums exchanged every second step, as one process"):
    aggregated = make_model(0)
    aggregated.set_weights(initial)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9), backward_passes_per_step=2)
    compile_model(aggregated, optimizer)
    recorder = Recorder()
    aggregated.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    # Horovod sums the aggregated gradients; Keras' own accumulation averages them: twice the rate.
    expected = reference_fit(initial, keras.optimizers.SGD(2 * LR, momentum=0.9, gradient_accumulation_steps=2),
                             epochs=2)
    for epoch in range(2):
        same_on_every_rank(recorder.weights[epoch], f"aggregated.{epoch}")
        difference = max_difference(recorder.weights[epoch], expected.weights[epoch])
        assert difference < 1e-5, f"epoch {epoch}: max difference {difference}"
    assert int(optimizer.iterations.numpy()) == 2 * STEPS // 2, int(optimizer.iterations.numpy())

with check("run_eagerly, op=Sum, fp16 compression, rvod.tensorflow's DistributedOptimizer"):
    eager = make_model(0)
    eager.set_weights(initial)
    optimizer = rvod.tensorflow.DistributedOptimizer(keras.optimizers.SGD(LR / N), op=hvd.Sum,
                                                     compression=hvd.Compression.fp16)
    compile_model(eager, optimizer, run_eagerly=True)
    recorder = Recorder()
    eager.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    same_on_every_rank(recorder.weights[0], "eager")
    expected = reference_fit(initial, keras.optimizers.SGD(LR), epochs=1)
    difference = max_difference(recorder.weights[0], expected.weights[0])
    assert difference < 2e-3, f"max difference {difference}"


# ----------------------------------------------------------------------------- load_model, helpers

with check("load_model: the optimizer comes back distributed with its state, and training goes on"):
    directory = hnp.broadcast_object(tempfile.mkdtemp() if R == 0 else None, root_rank=0)
    path = os.path.join(directory, "checkpoint.keras")
    if R == 0:
        model.save(path)
    hnp.barrier()
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, _DistributedOptimizer), type(loaded.optimizer).__mro__
    assert type(loaded.optimizer).__name__ == "SGD"
    assert int(loaded.optimizer.iterations.numpy()) == EPOCHS * STEPS, int(loaded.optimizer.iterations.numpy())
    momentums = [v.numpy() for v in loaded.optimizer.variables if "momentum" in v.path]
    assert momentums and all(np.abs(m).max() > 0 for m in momentums), "momentum slots were not restored"
    recorder = Recorder()
    loaded.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    same_on_every_rank(recorder.weights[0], "loaded")
    assert int(loaded.optimizer.iterations.numpy()) == (EPOCHS + 1) * STEPS

with check("value helpers, broadcast_global_variables, and one implementation behind rvod.tensorflow.keras"):
    assert np.array_equal(hvd.allreduce(np.array([R, 2.0 * R])), np.array([(N - 1) / 2, N - 1.0]))
    assert np.array_equal(hvd.allreduce(tf.constant([1, 2]), op=hvd.Sum), np.array([N, 2 * N]))
    assert np.array_equal(hvd.allgather(np.array([R])), np.arange(N))
    assert np.array_equal(hvd.broadcast(np.array([R + 7]), root_rank=N - 1), np.array([N + 6]))
    assert np.array_equal(hvd.reducescatter(np.ones(2 * N), op=hvd.Sum), np.full(2, N))
    drifted = make_model(200 + R)
    compile_model(drifted, keras.optimizers.SGD(0.1))
    hvd.broadcast_global_variables(0, drifted)
    same_on_every_rank(drifted.get_weights(), "drifted")
    expect_error(RuntimeError, "model", hvd.broadcast_global_variables, 0)
    assert rvod.tensorflow.keras.DistributedOptimizer is hvd.DistributedOptimizer
    assert rvod.tensorflow.keras.callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback
    assert rvod.tensorflow.keras.load_model is hvd.load_model

with check("DistributedOptimizer argument errors"):
    expect_error(TypeError, "keras.optimizers.Optimizer", hvd.DistributedOptimizer, object())
    expect_error(ValueError, "Average or Sum", hvd.DistributedOptimizer, keras.optimizers.SGD(), op=hvd.Max)
    # Horovod's Keras refuses Adasum; rvod's combines parameter updates with it (tests/python/test_adasum.py).
    assert isinstance(hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum), keras.optimizers.Optimizer)
    expect_error(ValueError, "already", hvd.DistributedOptimizer, hvd.DistributedOptimizer(keras.optimizers.SGD()))
    expect_error(ValueError, "backward_passes_per_step", hvd.DistributedOptimizer, keras.optimizers.SGD(),
                 backward_passes_per_step=0)
    expect_error(ValueError, "gradient_accumulation_steps", hvd.DistributedOptimizer,
                 keras.optimizers.SGD(gradient_accumulation_steps=2), backward_passes_per_step=2)

hvd.shutdown()
finish(R)
