"""Data-parallel training of a small CNN on scikit-learn's digits data with rvod.tensorflow, in a custom
TensorFlow 2 loop.

A Horovod TF2 script with one changed import: each rank trains on its own shard, the learning rate is
scaled by the number of ranks, rank 0's initial model and optimizer variables are broadcast, and
DistributedGradientTape averages the gradients inside a tf.function training step; metrics are averaged
with allreduce and only rank 0 prints and saves a checkpoint. It ends with the test accuracy. Run it with:

    rvodrun -np 2 python examples/tensorflow2_digits.py
"""

import argparse
import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rvod.tensorflow as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
    parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 saves the final weights")
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
    tf.config.threading.set_intra_op_parallelism_threads(1)  # one core per rank
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns the ranks

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target, test_size=0.25,
                                                        random_state=args.seed)
    # Every rank takes the same number of whole batches of its own shard.
    steps = len(x_train) // (hvd.size() * args.batch_size)
    shard = slice(hvd.rank(), steps * hvd.size() * args.batch_size, hvd.size())
    dataset = tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))

    model = digits_model()
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)

    @tf.function
    def training_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    start = time.perf_counter()
    for epoch in range(args.epochs):
        losses = [training_step(x, y) for x, y in dataset.shuffle(1024, seed=args.seed + epoch).batch(args.batch_size)]
        mean_loss = float(hvd.allreduce(tf.reduce_mean(losses), name="train.loss"))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f} (mean over ranks)", flush=True)

    # Data-parallel training keeps every rank's weights identical.
    for variable in model.variables:
        if not np.array_equal(hvd.broadcast(variable, root_rank=0).numpy(), variable.numpy()):
            raise SystemExit(f"rank {hvd.rank()}: {variable.path} differs from rank 0's")
    # Every rank scores its share of the test set; the counts are summed.
    mine = slice(hvd.rank(), None, hvd.size())
    predictions = np.argmax(model(x_test[mine], training=False), axis=1)
    counts = hvd.allreduce(tf.constant([(predictions == y_test[mine]).sum(), len(predictions)]), op=hvd.Sum,
                           name="test.counts")
    accuracy = float(counts[0] / counts[1])
    if hvd.rank() == 0:
        checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="tensorflow2_digits.")
        model.save_weights(os.path.join(checkpoint_dir, "digits.weights.h5"))
        print(f"trained on {hvd.size()} ranks in {time.perf_counter() - start:.1f} s; test accuracy {accuracy:.4f}; "
              f"checkpoint in {checkpoint_dir}", flush=True)
    hvd.shutdown()
    if accuracy <= 0.9:
        raise SystemExit(f"test accuracy {accuracy:.3f} is not above 0.9")


if __name__ == "__main__":
    main()
