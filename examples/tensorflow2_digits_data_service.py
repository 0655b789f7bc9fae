"""Data-parallel Keras training on scikit-learn's digits data, the input pipeline run by a tf.data service
(rvod's version of Horovod's tensorflow2_mnist_data_service.py).

A compute job runs tf.data service dispatchers and workers and writes a config file; this training job reads
it and sends its dataset pipeline (repeat, shuffle, batch) to the service, so those steps run in the compute
job's processes while the ranks train. The dispatchers run in the compute job (default), or in this job with
``--dispatcher-side training``; this script handles both. Rank 0 asks the compute job to shut down at the
end and prints the test accuracy. Start the compute job, then the training job (one host, loopback):

    rvodrun -np 2 python -m rvod.tensorflow.data.compute_worker /tmp/compute.json &
    rvodrun -np 2 python examples/tensorflow2_digits_data_service.py /tmp/compute.json

One dispatcher per training rank (the compute job's size is a multiple of --dispatchers, which must be the
training job's size), or dispatchers in the training job:

    rvodrun -np 4 python -m rvod.tensorflow.data.compute_worker --dispatchers 2 /tmp/compute.json &
    rvodrun -np 2 python examples/tensorflow2_digits_data_service.py /tmp/compute.json

    rvodrun -np 1 python -m rvod.tensorflow.data.compute_worker --dispatcher-side training /tmp/compute.json &
    rvodrun -np 2 python examples/tensorflow2_digits_data_service.py /tmp/compute.json

With one dispatcher, ``--reuse-dataset`` makes the ranks share one pass over the data instead of each taking
its own, first come first served (or ``--round-robin``).
"""

import argparse
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from keras_digits import digits_model
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rvod.tensorflow.keras as hvd
from rvod.tensorflow.data.compute_service import TfDataServiceConfig, tf_data_service


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configfile", help="the compute service config file the compute job writes")
    parser.add_argument("--reuse-dataset", action="store_true",
                        help="the ranks read from one shared dataset, first come first served")
    parser.add_argument("--round-robin", action="store_true", help="with --reuse-dataset: round robin instead")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def digits():
    data = load_digits()
    images = (data.images / 16.0).astype("float32")[..., None]
    return train_test_split(images, data.target, test_size=0.25, random_state=42)


class BatchCounter(keras.callbacks.Callback):
    """How many batches this rank trained on (fewer than asked if the service ran out of data)."""

    batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def train(args, dataset, x_test, y_test):
    """Fits the model on batches from the service; returns (batches per rank, test accuracy)."""
    steps_per_epoch = len(digits()[0]) // (hvd.size() * args.batch_size)
    model = digits_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    counter = BatchCounter()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), counter]
    model.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    batches = [int(n) for n in hvd.allgather(np.array([counter.batches]), name="batches")]
    if len(set(batches)) != 1:
        raise SystemExit(f"the ranks trained on different numbers of batches: {batches}")
    mine = slice(hvd.rank(), None, hvd.size())
    predictions = model.predict(x_test[mine], verbose=0).argmax(axis=1)
    correct, total = hvd.allreduce(np.array([(predictions == y_test[mine]).sum(), len(predictions)]), op=hvd.Sum,
                                   name="test.counts")
    return batches[0], correct / total


def main():
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())
    config = TfDataServiceConfig.read(args.configfile, wait_for_file_creation=True)
    if config.dispatchers > 1 and config.dispatchers != hvd.size():
        sys.exit(f"Unless there is only one dispatcher, the number of training ranks ({hvd.size()}) must match the "
                 f"number of dispatchers ({config.dispatchers}) in {args.configfile}")
    x_train, x_test, y_train, y_test = digits()
    # Everything before the data service runs in the compute job; each rank shuffles its own way.
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat()
               .shuffle(1024, seed=args.seed + hvd.rank()).batch(args.batch_size))

    start = time.perf_counter()
    if config.dispatcher_side == "compute":
        dataset = dataset.send_to_data_service(config, hvd.rank(), hvd.size(), reuse_dataset=args.reuse_dataset,
                                               round_robin=args.round_robin)
        steps, accuracy = train(args, dataset.prefetch(tf.data.AUTOTUNE), x_test, y_test)
    else:
        # This job runs the dispatcher(s): they serve while the with-block runs.
        with tf_data_service(config, hvd.rank()) as dispatcher_address:
            dataset = dataset.apply(tf.data.experimental.service.distribute(
                processing_mode="distributed_epoch", service=dispatcher_address,
                job_name="job" if args.reuse_dataset else None,
                consumer_index=hvd.rank() if args.round_robin else None,
                num_consumers=hvd.size() if args.round_robin else None))
            # train() ends with an allreduce: no rank still reads from rank 0's dispatcher when it stops.
            steps, accuracy = train(args, dataset.prefetch(tf.data.AUTOTUNE), x_test, y_test)
    if hvd.rank() == 0:
        config.compute_client().shutdown()
        print(f"trained on {hvd.size()} ranks in {time.perf_counter() - start:.1f} s with data from "
              f"{config.dispatchers * config.workers_per_dispatcher} tf.data worker(s) of {config.dispatchers} "
              f"dispatcher(s) ({config.dispatcher_side} side): {steps} batches of {args.batch_size} per rank, "
              f"test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()
    if accuracy <= 0.9:
        raise SystemExit(f"test accuracy {accuracy:.3f} is not above 0.9")


if __name__ == "__main__":
    main()
