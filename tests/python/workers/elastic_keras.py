"""An elastic Keras 3 job (TensorFlow backend) for tests/python/test_elastic.py: model.fit with
DistributedOptimizer and the elastic callbacks, under hvd.elastic.run. With ELASTIC_KILL="round:rank:epoch:batch"
the rank so placed kills itself with SIGKILL at the end of that batch. Every rank writes OUT/starts.jsonl
(world, rank, size, epoch, a checksum of its weights) each time training starts, and OUT/done.jsonl at the end.
With ELASTIC_SHARDED=1 the optimizer is a sharded Adam; the starts then carry a checksum of its consolidated
state, and rank 0 writes OUT/commits.jsonl (world, epoch, batch, that checksum) at every commit.
"""

import json
import os
import signal
import time

import keras
import numpy as np

import rvod.keras as hvd

OUT = os.environ["ELASTIC_OUT"]
EPOCHS = 3
KILL = tuple(int(x) for x in os.environ["ELASTIC_KILL"].split(":")) if os.environ.get("ELASTIC_KILL") else None
SHARDED = os.environ.get("ELASTIC_SHARDED") == "1"


def record(name, **fields):
    fields.update(time=time.time(), pid=os.getpid())
    with open(os.path.join(OUT, name), "a") as file:
        file.write(json.dumps(fields) + "\n")


def world():
    return int(os.environ.get("RVOD_ELASTIC_ROUND", "0"))


def checksum(model):
    return float(sum(float(np.sum(keras.ops.convert_to_numpy(v))) for v in model.variables))


hvd.init()
keras.utils.set_random_seed(1)
x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.Adam(0.05) if SHARDED else keras.optimizers.SGD(0.05)
model.compile(optimizer=hvd.DistributedOptimizer(optimizer, sharded=SHARDED), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0, batch=0)


def optimizer_checksum():
    """Of the consolidated state of the sharded optimizer (collective); None for a plain one."""
    if not SHARDED:
        return None
    return float(sum(float(np.sum(v)) for v in model.optimizer.consolidate_state_dict(to=None)))


class RecordCommits(keras.callbacks.Callback):
    def on_batch_end(self, batch, logs=None):
        committed = optimizer_checksum()
        if hvd.rank() == 0 and SHARDED:
            record("commits.jsonl", round=world(), epoch=state.epoch, batch=state.batch, optimizer=committed)


class KillAt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_batch_end(self, batch, logs=None):
        time.sleep(0.05)
        if KILL == (world(), hvd.rank(), self.epoch, batch):
            record("kills.jsonl", round=world(), rank=hvd.rank(), epoch=self.epoch, batch=batch)
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    record("starts.jsonl", round=world(), rank=hvd.rank(), size=hvd.size(), epoch=state.epoch,
           params=checksum(state.model), optimizer=optimizer_checksum())
    rows = np.arange(hvd.rank(), len(x), hvd.size())
    state.model.fit(x[rows], y[rows], batch_size=4, epochs=EPOCHS, initial_epoch=state.epoch, verbose=0,
                    callbacks=[KillAt(), hvd.elastic.UpdateBatchStateCallback(state),
                               hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.CommitStateCallback(state),
                               RecordCommits()])


train(state)
record("done.jsonl", round=world(), rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, params=checksum(model))
