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

import keras

import estimator_digits
from rvod.spark.keras import KerasEstimator


LEARNING_RATE = 0.005


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                             keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def make_estimator(args, store):
    model = build_model()  # each row's 64 features are reshaped to the model's (8, 8, 1)
    return KerasEstimator(
        num_proc=args.num_proc, store=store, model=model, optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], validation=0.1, batch_size=args.batch_size, epochs=args.epochs,
        random_seed=0, partitions_per_process=2, run_id="digits", verbose=1)


def main(argv=None):
    """Returns the fitted model and the store (gone with its temporary folder unless --store was given)."""
    return estimator_digits.main(argv, __doc__.splitlines()[0], make_estimator,
                                 lambda fitted: fitted.getHistory()["val_accuracy"][-1])


if __name__ == "__main__":
    main()
