"""The Spark ML params of the estimators and of the models they return, with Horovod's names and defaults.

Each param ``snake_name`` has ``getSnakeName()``/``setSnakeName(value)`` (``getNumProc``, ``setFeatureCols``,
...), as in horovod.spark.common.params; ``setParams(**kwargs)`` sets several.
"""

from __future__ import annotations

from typing import Any

from pyspark import keyword_only
from pyspark.ml.param.shared import HasOutputCols, Param, Params, TypeConverters

# name: (doc, type converter or None, default)
ESTIMATOR_PARAMS: dict[str, tuple[str, Any, Any]] = {
    "num_proc": ("number of processes (ranks)", None, None),
    "model": ("model to train", None, None),
    "backend": ("Backend running the training function (default: SparkBackend of num_proc ranks)", None, None),
    "store": ("Store for the intermediate data, checkpoints and logs", None, None),
    "optimizer": ("optimizer, wrapped in hvd.DistributedOptimizer on every rank", None, None),
    "loss": ("loss, or a list of losses (one per label column)", None, None),
    "loss_weights": ("weights of the losses", TypeConverters.toListFloat, None),
    "sample_weight_col": ("column of sample weights", TypeConverters.toString, None),
    "metrics": ("metrics recorded each epoch", None, []),
    "feature_cols": ("feature column names", TypeConverters.toListString, None),
    "label_cols": ("label column names", TypeConverters.toListString, None),
    "validation": ("validation fraction (float in [0, 1)) or name of a column that is 1/True for validation rows",
                   None, None),
    "callbacks": ("callbacks", None, []),
    "batch_size": ("rows per batch on each rank", TypeConverters.toInt, 32),
    "val_batch_size": ("rows per validation batch (default: batch_size)", TypeConverters.toInt, None),
    "epochs": ("epochs", TypeConverters.toInt, 1),
    "train_steps_per_epoch": ("batches per epoch on each rank (default: the rows / (batch_size * num_proc))",
                              TypeConverters.toInt, None),
    "validation_steps_per_epoch": ("validation batches per epoch on each rank (default: all of the rank's rows)",
                                   TypeConverters.toInt, None),
    "verbose": ("verbosity: 0 silent, 1 a line per epoch from rank 0", TypeConverters.toInt, 1),
    "gradient_compression": ("hvd.Compression used by the DistributedOptimizer", None, None),
    "partitions_per_process": ("Parquet partitions (files) written per rank", TypeConverters.toInt, 10),
    "run_id": ("name of the run in the store; an existing run's checkpoint is resumed from", TypeConverters.toString,
               None),
    "transformation_fn": ("function applied to each batch (a dict of column -> numpy array) before training",
                          None, None),
    "label_shapes": ("shapes of the label columns", None, None),
    "shuffle": ("shuffle the rows of each rank every epoch", TypeConverters.toBoolean, True),
    "random_seed": ("seed of the model's framework and of the shuffling", None, None),
}

MODEL_PARAMS: dict[str, tuple[str, Any, Any]] = {
    "history": ("metrics of every epoch of training", None, None),
    "model": ("the trained model", None, None),
    "feature_columns": ("feature column names", None, None),
    "label_columns": ("label column names", None, None),
    "run_id": ("the run that trained the model", TypeConverters.toString, None),
    "_metadata": ("shapes and Spark types of the columns trained on", None, None),
}


def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.strip("_").split("_"))


def declare(cls: type, params: dict[str, tuple[str, Any, Any]]) -> type:
    """Give ``cls`` a Param and a getter/setter pair for each of ``params`` (existing methods win)."""
    for name, (doc, converter, _) in params.items():
        if converter is None:
            setattr(cls, name, Param(Params._dummy(), name, doc))
        else:
            setattr(cls, name, Param(Params._dummy(), name, doc, typeConverter=converter))

        def getter(self, _name=name):
            return self.getOrDefault(getattr(self, _name))

        def setter(self, value, _name=name):
            return self._set(**{_name: value})

        for prefix, method in (("get", getter), ("set", setter)):
            method_name = prefix + camel(name)
            if method_name not in cls.__dict__:
                method.__name__ = method_name
                setattr(cls, method_name, method)
    return cls


class EstimatorParams(Params):
    """The params every estimator has."""

    def __init__(self):
        super().__init__()
        self._setDefault(**{name: default for name, (_, _, default) in ESTIMATOR_PARAMS.items()})

    @keyword_only
    def setParams(self, **kwargs):
        return self._set(**kwargs)


class ModelParams(HasOutputCols):
    """The params every returned model has; ``outputCols`` are ``<label>__output``."""

    def __init__(self):
        super().__init__()
        self._setDefault(**{name: default for name, (_, _, default) in MODEL_PARAMS.items()})

    @keyword_only
    def setParams(self, **kwargs):
        return self._set(**kwargs)

    def _get_metadata(self):
        return self.getOrDefault(self._metadata)

    def setOutputCols(self, value):
        return self._set(outputCols=value)


declare(EstimatorParams, ESTIMATOR_PARAMS)
declare(ModelParams, MODEL_PARAMS)
