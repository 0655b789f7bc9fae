"""Resharding a Keras sharded optimizer, run by rvodrun with 3 ranks on the files workers/keras_sharded.py
wrote with 2 (the directory is the argument): the list of the 2 ranks' state_dict() loads into 3 shards
whose consolidation is the 2-rank job's; so does the consolidated state loaded on rank 0 alone and sent by
broadcast_global_variables; both train on as the plain DistributedOptimizer loaded with the consolidated
state does; a single rank's state_dict() of the 2-rank job is refused.
"""

import os
import pickle
import sys

import keras
import numpy as np
import tensorflow as tf
from _check import check, expect_error, finish

import rvod.keras as hvd

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
R, N = hvd.rank(), hvd.size()
BATCH, STEPS = 4, 5
OUT = sys.argv[1]

rng = np.random.default_rng(10 + R)
X = rng.normal(size=(BATCH * STEPS, 5)).astype(np.float32)
Y = rng.normal(size=(BATCH * STEPS, 3)).astype(np.float32)

with open(os.path.join(OUT, "checkpoint.pkl"), "rb") as file:
    checkpoint = pickle.load(file)
saved = []
for rank in range(2):
    with open(os.path.join(OUT, f"sharded_{rank}.pkl"), "rb") as file:
        saved.append(pickle.load(file))


def make_model(optimizer):
    """workers/keras_sharded.py's model with the checkpoint's weights, ``optimizer`` built on it."""
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])
    model.set_weights(checkpoint["weights"])
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def go_on(model):
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


plain = make_model(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
plain.optimizer.set_weights(checkpoint["whole"])
go_on(plain)

with check(f"the 2 ranks' state_dict() load into {N} shards: the same consolidated state, the same training"):
    model = make_model(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), sharded=True))
    model.optimizer.load_state_dict(saved)
    assert same(model.optimizer.consolidate_state_dict(to=None), checkpoint["whole"])
    difference = max(float(np.abs(a - b).max()) for a, b in zip(go_on(model).get_weights(), plain.get_weights()))
    assert difference < 1e-6, f"parameters differ by {difference}"

with check("the consolidated state loaded on rank 0 alone reaches every rank's shard by broadcast_global_variables"):
    model = make_model(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), sharded=True))
    if R == 0:
        model.optimizer.load_state_dict(checkpoint["whole"])
    hvd.broadcast_global_variables(0, model)
    assert same(model.optimizer.consolidate_state_dict(to=None), checkpoint["whole"])
    difference = max(float(np.abs(a - b).max()) for a, b in zip(go_on(model).get_weights(), plain.get_weights()))
    assert difference < 1e-6, f"parameters differ by {difference}"

with check("one rank's state_dict() of the 2-rank job is refused, saying what to load"):
    expect_error(ValueError, r"this state dict is rank 0's shard of a sharded optimizer of 2 ranks; this one is rank "
                 rf"{R} of {N}: load the list of every rank's state_dict\(\)", model.optimizer.load_state_dict, saved[0])

finish(R)
