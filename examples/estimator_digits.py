"""What examples/spark_torch_estimator_digits.py and examples/spark_keras_estimator_digits.py share: their
command line, a Spark session, scikit-learn's digits as train and test DataFrames (64 features in [0, 1]
and a label per row), a store, the fit, and the report of the fitted model's transform on the test set."""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import pandas as pd
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from rvod.spark.common.store import Store


def main(argv, description, make_estimator, validation_accuracy):
    """Fit ``make_estimator(args, store)`` to the training DataFrame and report; ``validation_accuracy(model)``
    reads the last epoch's validation accuracy off the fitted model. Returns the fitted model and the store
    (gone with its temporary folder unless --store was given)."""
    parser = argparse.ArgumentParser(description=description)
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

        with tempfile.TemporaryDirectory(prefix="rvod-store-") as folder:
            store = Store.create(args.store or folder)
            estimator = make_estimator(args, store)
            start = time.perf_counter()
            fitted = estimator.fit(train)
            seconds = time.perf_counter() - start
            print(f"checkpoint in the store: {store.exists(store.get_checkpoint_path('digits'))}")

        rows = fitted.transform(test).select("label", "label__output").collect()
        predicted = np.array([row["label__output"].toArray().argmax() for row in rows])
        labels = np.array([row["label"] for row in rows])
        print(f"trained on {args.num_proc} ranks in {seconds:.1f} s; validation accuracy "
              f"{validation_accuracy(fitted):.3f}; test accuracy {float((predicted == labels).mean()):.3f}")
    finally:
        if started_here:
            spark.stop()
    return fitted, store
