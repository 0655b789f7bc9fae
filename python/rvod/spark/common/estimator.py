"""What the Spark estimators share: ``HorovodEstimator.fit`` (check the params, write the DataFrame to the
store, run the framework's training function on the backend's ranks, wrap the result in a model) and
``HorovodModel.transform`` (predict every row, add a ``<label>__output`` column per label)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pyspark.ml import Estimator, Model

from rvod.spark.common import data
from rvod.spark.common.backend import SparkBackend
from rvod.spark.common.params import EstimatorParams, ModelParams

WHERE = "rvod.spark"
# Rows predicted together in transform.
PREDICT_BATCH_ROWS = 256


class HorovodEstimator(Estimator, EstimatorParams):
    """Fits a model to a DataFrame on ``num_proc`` ranks; subclasses say how one rank trains."""

    run_id_prefix = "run"

    def fit(self, df, params=None):
        """Train on ``df`` and return the fitted model (a Spark Transformer)."""
        return super().fit(df, params)

    def _fit(self, df):
        self._check_params()
        backend = self._get_or_create_backend()
        num_proc = backend.num_processes()
        prepared = data.prepare_data(df, self.getStore(), self.getFeatureCols(), self.getLabelCols(),
                                     self.getValidation(), self.getSampleWeightCol(),
                                     num_files=num_proc * self.getPartitionsPerProcess(), seed=self.getRandomSeed())
        run_id = self.getRunId() or f"{self.run_id_prefix}_{int(time.time() * 1000)}"
        return self._fit_on_prepared_data(backend, prepared, run_id)

    def _fit_on_prepared_data(self, backend, prepared: data.PreparedData, run_id: str):
        raise NotImplementedError

    def _check_params(self) -> None:
        missing = [name for name in ("model", "store", "feature_cols", "label_cols") if not self.getOrDefault(name)]
        if missing:
            raise ValueError(f"{WHERE}: {type(self).__name__} needs the params {missing}")
        label_cols, losses = self.getLabelCols(), self.getLoss()
        if isinstance(losses, (list, tuple)) and len(losses) != len(label_cols):
            raise ValueError(f"{WHERE}: {len(losses)} losses for {len(label_cols)} label columns")
        weights = self.getLossWeights()
        if weights is not None and len(weights) != len(label_cols):
            raise ValueError(f"{WHERE}: {len(weights)} loss weights for {len(label_cols)} label columns")

    def _get_or_create_backend(self):
        backend, num_proc = self.getBackend(), self.getNumProc()
        if backend is not None and num_proc is not None:
            raise ValueError(f"{WHERE}: give num_proc or backend, not both (the backend says how many ranks run)")
        return backend or SparkBackend(num_proc=num_proc, verbose=self.getVerbose())

    def training_settings(self, prepared: data.PreparedData, run_id: str) -> dict[str, Any]:
        """What every rank's training function needs of the params, picklable."""
        store = self.getStore()
        return {
            "store": store, "run_id": run_id, "train_path": prepared.train_path, "val_path": prepared.val_path,
            "train_rows": prepared.train_rows, "val_rows": prepared.val_rows,
            "checkpoint_path": store.get_checkpoint_path(run_id),
            "feature_cols": list(self.getFeatureCols()), "label_cols": list(self.getLabelCols()),
            "sample_weight_col": self.getSampleWeightCol(), "batch_size": self.getBatchSize(),
            "val_batch_size": self.getValBatchSize() or self.getBatchSize(), "epochs": self.getEpochs(),
            "train_steps_per_epoch": self.getTrainStepsPerEpoch(),
            "validation_steps_per_epoch": self.getValidationStepsPerEpoch(), "verbose": self.getVerbose(),
            "shuffle": self.getShuffle(), "random_seed": self.getRandomSeed(),
            "transformation_fn": self.getTransformationFn(), "loss_weights": self.getLossWeights(),
            "gradient_compression": self.getGradientCompression(), "metrics": list(self.getMetrics() or []),
            "callbacks": list(self.getCallbacks() or []),
        }


def load_rank_data(settings: dict[str, Any], rank: int, size: int):
    """The rank's training batches and validation arrays (None without validation rows for this rank)."""
    columns = settings["feature_cols"] + settings["label_cols"] + (
        [settings["sample_weight_col"]] if settings["sample_weight_col"] else [])
    store = settings["store"]
    train = data.read_shard(store, settings["train_path"], rank, size, columns)
    steps = data.steps_per_epoch(settings["train_rows"], settings["batch_size"], size,
                                 settings["train_steps_per_epoch"])
    seed = settings["random_seed"] if settings["random_seed"] is not None else 0
    batches = data.Batches(train, settings["batch_size"], steps, settings["shuffle"], seed * 1000 + rank)
    val = None
    if settings["val_path"] is not None:
        val = data.read_shard(store, settings["val_path"], rank, size, columns, allow_empty=True)
    return batches, val


class HorovodModel(Model, ModelParams):
    """A fitted model as a Spark Transformer: ``transform(df)`` adds ``<label>__output`` columns (a label's
    Spark type where the model gives one value per row, else a DenseVector of the model's outputs)."""

    def __init__(self):
        super().__init__()

    def _predict_fn(self) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
        """A picklable function from feature batches (one array per feature column) to output batches."""
        raise NotImplementedError

    def getOutputCols(self):
        if self.isDefined(self.outputCols):
            return self.getOrDefault(self.outputCols)
        return [f"{label}__output" for label in self.getLabelColumns()]

    def _transform(self, df):
        from pyspark.ml.linalg import DenseVector, VectorUDT
        from pyspark.sql import Row
        from pyspark.sql.types import StructField, StructType, _parse_datatype_json_string

        feature_cols, label_cols = list(self.getFeatureColumns()), list(self.getLabelColumns())
        output_cols, metadata = list(self.getOutputCols()), self._get_metadata()
        missing = [column for column in feature_cols if column not in df.columns]
        if missing:
            raise ValueError(f"{WHERE}: feature columns {missing} are not in the DataFrame to transform")
        predict = self._predict_fn()
        first = df.select(*feature_cols).first()
        if first is None:  # nothing to learn the outputs' shapes from: vectors
            return df.sparkSession.createDataFrame([], StructType(
                list(df.schema.fields) + [StructField(name, VectorUDT(), True) for name in output_cols]))
        probe = predict(features_of([first], feature_cols))
        if len(probe) != len(label_cols):
            raise ValueError(f"{WHERE}: the model gives {len(probe)} outputs for {len(label_cols)} label columns")
        scalar_types = []
        for label, output in zip(label_cols, probe):
            meta = metadata[label] if metadata else {"kind": "array"}
            per_row = int(np.prod(output.shape[1:])) if output.ndim > 1 else 1
            scalar = meta["kind"] == "scalar" and per_row == 1
            scalar_types.append(_parse_datatype_json_string(meta["spark_type_json"]) if scalar else None)
        schema = StructType(list(df.schema.fields) + [
            StructField(name, kind if kind is not None else VectorUDT(), True)
            for name, kind in zip(output_cols, scalar_types)])
        integral = [kind is not None and kind.typeName() in ("byte", "short", "integer", "long")
                    for kind in scalar_types]

        def values(kind, is_integral, outputs):
            if kind is None:
                return [DenseVector(row.reshape(-1).astype(np.float64)) for row in outputs]
            flat = outputs.reshape(len(outputs))
            return [int(round(float(value))) for value in flat] if is_integral else [float(value) for value in flat]

        def predict_partition(rows):
            chunk = []
            for row in rows:
                chunk.append(row)
                if len(chunk) == PREDICT_BATCH_ROWS:
                    yield from emit(chunk)
                    chunk = []
            if chunk:
                yield from emit(chunk)

        def emit(chunk):
            outputs = predict(features_of(chunk, feature_cols))
            columns = [values(kind, is_integral, np.asarray(out))
                       for kind, is_integral, out in zip(scalar_types, integral, outputs)]
            for index, row in enumerate(chunk):
                yield Row(*row, *(column[index] for column in columns))

        return df.sparkSession.createDataFrame(df.rdd.mapPartitions(predict_partition), schema)


def features_of(rows: Sequence[Any], feature_cols: Sequence[str]) -> list[np.ndarray]:
    """One array per feature column of ``rows`` (vectors and arrays become 2-D)."""
    arrays = []
    for column in feature_cols:
        cells = [row[column] for row in rows]
        cells = [cell.toArray() if hasattr(cell, "toArray") else cell for cell in cells]
        arrays.append(data.as_model_array(np.asarray(cells)))
    return arrays
