"""Data-parallel training of a small CNN on scikit-learn's digits data with rvod.keras (Keras 3).

A Horovod Keras script with one changed import: each rank fits on its own shard of the data, the learning
rate is scaled by the number of ranks and warmed up over the first epochs, rank 0's initial weights are
broadcast, DistributedOptimizer averages gradients, metrics are averaged over the ranks, and only rank 0
prints and writes checkpoints. It ends with the test accuracy. Run it with:

    rvodrun -np 2 python examples/keras_digits.py
"""

import argparse
import os
import tempfile
import time

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rvod.keras as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 saves a checkpoint every epoch")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def digits_model():
    """Two 3x3 convolutions, a pooling layer and two dense layers for 8x8 images."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10),
    ])


def main():
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns the ranks

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target, test_size=0.25,
                                                        random_state=args.seed)
    # Every rank takes the same number of whole batches of its own shard.
    steps = len(x_train) // (hvd.size() * args.batch_size)
    shard = slice(hvd.rank(), steps * hvd.size() * args.batch_size, hvd.size())
    x_train, y_train = x_train[shard], y_train[shard]

    model = digits_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * hvd.size(), warmup_epochs=args.warmup_epochs,
                                                 momentum_correction=False, verbose=1),
    ]
    if hvd.rank() == 0:
        checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="keras_digits.")
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "checkpoint.keras")))

    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)

    # Data-parallel training keeps every rank's weights identical.
    for i, weight in enumerate(model.get_weights()):
        if not np.array_equal(hvd.broadcast(weight, root_rank=0, name=f"check.{i}"), weight):
            raise SystemExit(f"rank {hvd.rank()}: weight {i} differs from rank 0's")
    # Every rank scores its share of the test set; the counts are summed.
    mine = slice(hvd.rank(), None, hvd.size())
    predictions = model.predict(x_test[mine], verbose=0).argmax(axis=1)
    correct, total = hvd.allreduce(np.array([(predictions == y_test[mine]).sum(), len(predictions)]), op=hvd.Sum,
                                   name="test.counts")
    accuracy = correct / total
    if hvd.rank() == 0:
        print(f"trained on {hvd.size()} ranks in {time.perf_counter() - start:.1f} s; test accuracy {accuracy:.4f}; "
              f"checkpoint in {checkpoint_dir}", flush=True)
    hvd.shutdown()
    if accuracy <= 0.9:
        raise SystemExit(f"test accuracy {accuracy:.3f} is not above 0.9")


if __name__ == "__main__":
    main()
