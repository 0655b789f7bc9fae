"""What each rank of a KerasEstimator fit runs: load the model, compile it with
``rvod.keras.DistributedOptimizer``, ``model.fit`` on its share of the data (initial state broadcast from
rank 0, metrics averaged over the ranks), rank 0 writing the model to the store's checkpoint after every
epoch. Rank 0 returns ``(history, final model as .keras bytes)``."""

from __future__ import annotations

import os
import tempfile
from typing import Any


def model_to_bytes(model) -> bytes:
    """A Keras model as the bytes of a ``.keras`` archive."""
    with tempfile.TemporaryDirectory(prefix="rvod-keras-") as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        with open(path, "rb") as file:
            return file.read()


def model_from_bytes(data: bytes, custom_objects: dict[str, Any] | None = None, compile: bool = True):
    import keras

    with tempfile.TemporaryDirectory(prefix="rvod-keras-") as folder:
        path = os.path.join(folder, "model.keras")
        with open(path, "wb") as file:
            file.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=compile)


def model_inputs(model, batch, columns):
    """The feature columns shaped as the model's inputs."""
    arrays = [batch[column] for column in columns]
    shapes = [tuple(tensor.shape[1:]) for tensor in model.inputs]
    arrays = [array.reshape((len(array),) + shape) if None not in shape else array
              for array, shape in zip(arrays, shapes)]
    return arrays[0] if len(arrays) == 1 else arrays


def train(settings: dict[str, Any], model_bytes: bytes, optimizer_config: dict[str, Any],
          custom_objects: dict[str, Any] | None, loss, resume: bytes | None,
          backward_passes_per_step: int) -> tuple[dict[str, list[float]], bytes] | None:
    import keras

    import rvod.keras as hvd
    from rvod.spark.common.estimator import load_rank_data

    hvd.init()
    try:
        rank, size = hvd.rank(), hvd.size()
        if settings["random_seed"] is not None:
            keras.utils.set_random_seed(settings["random_seed"])
        model = model_from_bytes(resume or model_bytes, custom_objects, compile=False)
        optimizer = keras.optimizers.deserialize(optimizer_config, custom_objects=custom_objects)
        compression = settings["gradient_compression"] or hvd.Compression.none
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer, compression=compression,
                                                         backward_passes_per_step=backward_passes_per_step),
                      loss=loss, loss_weights=settings["loss_weights"], metrics=settings["metrics"])
        batches, val = load_rank_data(settings, rank, size)
        feature_cols, label_cols = settings["feature_cols"], settings["label_cols"]
        weight_col = settings["sample_weight_col"]

        def as_fit_data(batch):
            if settings["transformation_fn"] is not None:
                batch = settings["transformation_fn"](batch)
            labels = [batch[column] for column in label_cols]
            labels = labels[0] if len(labels) == 1 else labels
            x = model_inputs(model, batch, feature_cols)
            return (x, labels, batch[weight_col]) if weight_col else (x, labels)

        def forever():
            epoch = 0
            while True:
                for batch in batches.epoch(epoch):
                    yield as_fit_data(batch)
                epoch += 1

        validation_data = None
        if val is not None:
            validation_data = as_fit_data(val)
        elif settings["val_path"] is not None:
            raise ValueError(f"rvod.spark: rank {rank} has no validation rows; use fewer ranks or more "
                             f"partitions_per_process")
        checkpoint_path = settings["checkpoint_path"]

        class _Checkpoint(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if rank == 0 and checkpoint_path is not None:
                    settings["store"].write(checkpoint_path, model_to_bytes(self.model))

        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     *settings["callbacks"], _Checkpoint()]
        history = model.fit(forever(), steps_per_epoch=batches.steps, epochs=settings["epochs"],
                            validation_data=validation_data,
                            validation_batch_size=settings["val_batch_size"],
                            validation_steps=settings["validation_steps_per_epoch"], callbacks=callbacks,
                            verbose=(2 if settings["verbose"] else 0) if rank == 0 else 0)
        if rank != 0:
            return None
        return {name: [float(value) for value in values] for name, values in history.history.items()}, \
            model_to_bytes(model)
    finally:
        hvd.shutdown()
