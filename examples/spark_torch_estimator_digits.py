"""Fit a small CNN to a Spark DataFrame of scikit-learn's digits with rvod.spark.torch.TorchEstimator
(horovod.spark.torch's estimator), then predict with the returned TorchModel's transform.

    python examples/spark_torch_estimator_digits.py                       # Spark local[2], 2 ranks
    python examples/spark_torch_estimator_digits.py --master spark://host:7077 -np 4 --store /shared/rvod

The DataFrame goes to the store as Parquet; each rank reads its share, trains with
rvod.torch.DistributedOptimizer, and rank 0 writes a checkpoint to the store after every epoch. With
several hosts the store must be a path every host sees (or hdfs://...). Spark 4 needs Java 17 or 21; the
executors need this Python's packages (PYSPARK_PYTHON defaults to this interpreter here).
"""

import torch
from torch import nn

import estimator_digits
from rvod.spark.torch import TorchEstimator


LEARNING_RATE = 0.005


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def accuracy(output, label):
    return float((output.argmax(1) == label).float().mean())


def make_estimator(args, store):
    model = build_model()
    return TorchEstimator(
        num_proc=args.num_proc, store=store, model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=LEARNING_RATE), loss=nn.functional.cross_entropy,
        metrics=[accuracy], feature_cols=["features"], label_cols=["label"], input_shapes=[[-1, 1, 8, 8]],
        validation=0.1, batch_size=args.batch_size, epochs=args.epochs, random_seed=0,
        partitions_per_process=2, run_id="digits", verbose=1)


def main(argv=None):
    """Returns the fitted model and the store (gone with its temporary folder unless --store was given)."""
    return estimator_digits.main(argv, __doc__.splitlines()[0], make_estimator,
                                 lambda fitted: fitted.getHistory()[-1]["validation"]["accuracy"])


if __name__ == "__main__":
    main()
