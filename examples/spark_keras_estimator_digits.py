"""Fit a small Keras 3 model to a Spark DataFrame of scikit-learn's digits with
rvod.spark.keras.KerasEstimator (horovod.spark.keras's estimator), then predict with the returned
KerasModel's transform.

    python examples/spark_keras_estimator_digits.py                       # Spark local[2], 2 ranks
    python examples/spark_keras_estimator_digits.py --master spark://host:7077 -np 4 --store /shared/rvod

The DataFrame goes to the store as Parquet; each rank reads its share and runs model.fit with
rvod.keras.DistributedOptimizer; rank 0 writes the model to the store after every epoch. With several hosts
the store must be a path every host sees (or hdfs://...). Spark 4 needs Java 17 or 21; the executors need
this Python's packages (PYSPARK_PYTHON defaults to this interpreter here).
"""

import argparse
import os
import sys
import tempfile
import time

import keras
import numpy as np
import pandas as pd
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from rvod.spark.common.store import Store
from rvod.spark.keras import KerasEstimator


LEARNING_RATE = 0.005


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                             keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def main(argv=None):
    """Returns the fitted model and the store (gone with its temporary folder unless --store was given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    parser.add_argument("-np", "--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--store", help="store path (default: a temporary folder)")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    started_here = SparkSession.getActiveSession() is None
    spark = SparkSession.builder.master(args.master).appName("rvod estimator digits").getOrCreate()
    try:
        digits = load_digits()
        x = list((digits.data / 16.0).astype(np.float32))
        x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0)
        train = spark.createDataFrame(pd.DataFrame({"features": x_train, "label": y_train}))
        test = spark.createDataFrame(pd.DataFrame({"features": x_test, "label": y_test}))

        model = build_model()
        with tempfile.TemporaryDirectory(prefix="rvod-store-") as folder:
            store = Store.create(args.store or folder)
            estimator = KerasEstimator(
                num_proc=args.num_proc, store=store, model=model, optimizer=keras.optimizers.Adam(LEARNING_RATE),
                loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
                label_cols=["label"], validation=0.1, batch_size=args.batch_size, epochs=args.epochs,
                random_seed=0, partitions_per_process=2, run_id="digits", verbose=1)
            start = time.perf_counter()
            fitted = estimator.fit(train)  # each row's 64 features are reshaped to the model's (8, 8, 1)
            seconds = time.perf_counter() - start
            history = fitted.getHistory()
            print(f"checkpoint in the store: {store.exists(store.get_checkpoint_path('digits'))}")

        rows = fitted.transform(test).select("label", "label__output").collect()
        predicted = np.array([row["label__output"].toArray().argmax() for row in rows])
        labels = np.array([row["label"] for row in rows])
        print(f"trained on {args.num_proc} ranks in {seconds:.1f} s; validation accuracy "
              f"{history['val_accuracy'][-1]:.3f}; test accuracy {float((predicted == labels).mean()):.3f}")
    finally:
        if started_here:
            spark.stop()
    return fitted, store


if __name__ == "__main__":
    main()
