"""rvod.keras under Keras' torch backend, run by rvodrun with 2 ranks: model.fit with DistributedOptimizer
(gradients reduced through rvod.torch) matches one process training on the full batch, and the callbacks
keep the ranks identical."""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _check import check, finish  # noqa: E402

import rvod.keras as hvd  # noqa: E402
import rvod.numpy as hnp  # noqa: E402

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()
BATCH, STEPS = 8, 4
rng = np.random.default_rng(0)
X_ALL = rng.normal(size=(N * BATCH * STEPS, 6)).astype(np.float32)
Y_ALL = rng.integers(0, 3, size=N * BATCH * STEPS)
rows = np.concatenate([np.arange(k * N * BATCH + R * BATCH, k * N * BATCH + (R + 1) * BATCH) for k in range(STEPS)])


def make_model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    return model


def fit(model, optimizer, x, y, batch, callbacks=()):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))


with check("torch backend: fit matches one process on the full batch, identical on every rank"):
    assert keras.backend.backend() == "torch"
    model = make_model(100 + R)
    initial = [hnp.broadcast(w, root_rank=0, name=f"initial.{i}") for i, w in enumerate(model.get_weights())]
    history = fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), X_ALL[rows],
                  Y_ALL[rows], BATCH, [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hvd.callbacks.MetricAverageCallback()])
    reference = make_model(0)
    reference.set_weights(initial)
    fit(reference, keras.optimizers.SGD(0.1, momentum=0.9), X_ALL, Y_ALL, N * BATCH)
    for i, (weight, expected) in enumerate(zip(model.get_weights(), reference.get_weights())):
        assert np.array_equal(hnp.broadcast(weight, root_rank=0, name=f"final.{i}"), weight), f"weight {i} differs"
        assert np.abs(weight - expected).max() < 1e-5, f"weight {i}: {np.abs(weight - expected).max()}"
    losses = hnp.allgather(np.array(history.history["loss"]))
    assert np.array_equal(losses[:2], losses[2:]), losses

hvd.shutdown()
finish(R)
