"""``KerasEstimator`` and ``KerasModel``: horovod.spark.keras's API, for Keras 3."""

from __future__ import annotations

from pyspark import keyword_only

from rvod.spark.common.estimator import HorovodEstimator, HorovodModel
from rvod.spark.common.params import declare
from rvod.spark.keras import remote


class KerasEstimator(HorovodEstimator):
    """Spark Estimator fitting a Keras 3 model to a DataFrame on ``num_proc`` ranks.

    The params are Horovod's (``rvod.spark.common.params``) plus ``custom_objects`` (for loading the model
    on the ranks) and ``backward_passes_per_step``. ``optimizer`` is a Keras optimizer (its config travels
    to the ranks and is wrapped in ``rvod.keras.DistributedOptimizer``); ``loss`` and ``metrics`` are what
    ``model.compile`` takes (names, or objects that pickle); ``callbacks`` are Keras callbacks added to each
    rank's ``model.fit`` after rvod's broadcast and metric-average callbacks. Each feature column is
    reshaped to the model input's shape. After every epoch rank 0 writes the model (a ``.keras`` archive)
    to the store's checkpoint of the run; a fit with the ``run_id`` of a run that has a checkpoint starts
    from its weights.
    """

    run_id_prefix = "keras"

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, custom_objects=None, optimizer=None,
                 loss=None, loss_weights=None, sample_weight_col=None, gradient_compression=None, metrics=None,
                 feature_cols=None, label_cols=None, validation=None, callbacks=None, batch_size=None,
                 val_batch_size=None, epochs=None, verbose=1, shuffle=True, partitions_per_process=None,
                 run_id=None, train_steps_per_epoch=None, validation_steps_per_epoch=None, transformation_fn=None,
                 label_shapes=None, backward_passes_per_step=1, random_seed=None):
        super().__init__()
        self._setDefault(custom_objects={}, backward_passes_per_step=1)
        self._set(**{key: value for key, value in self._input_kwargs.items() if value is not None})

    def _fit_on_prepared_data(self, backend, prepared, run_id):
        import keras

        store = self.getStore()
        optimizer = self.getOptimizer()
        if optimizer is None or self.getLoss() is None:
            raise ValueError("rvod.spark: KerasEstimator needs an optimizer and a loss")
        path = store.get_checkpoint_path(run_id)
        resume = store.read(path) if path is not None and store.exists(path) else None
        if resume is not None and self.getVerbose():
            print(f"rvod.spark: run {run_id} starts from the weights of its checkpoint {path}")
        settings = self.training_settings(prepared, run_id)
        results = backend.run(remote.train, args=(
            settings, remote.model_to_bytes(self.getModel()), keras.optimizers.serialize(optimizer),
            self.getCustomObjects(), self.getLoss(), resume, self.getBackwardPassesPerStep()))
        history, model_bytes = results[0]
        trained = remote.model_from_bytes(model_bytes, self.getCustomObjects())
        return KerasModel(history=history, model=trained, feature_columns=self.getFeatureCols(),
                          label_columns=self.getLabelCols(), custom_objects=self.getCustomObjects(), run_id=run_id,
                          _metadata=prepared.metadata)


class KerasModel(HorovodModel):
    """Spark Transformer around a trained Keras model (``getModel()``); ``transform(df)`` adds a
    ``<label>__output`` column per label column."""

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, label_columns=None, custom_objects=None,
                 run_id=None, _metadata=None):
        super().__init__()
        self._setDefault(custom_objects={})
        self._set(**{key: value for key, value in self._input_kwargs.items() if value is not None})

    def _predict_fn(self):
        model_bytes, custom_objects = remote.model_to_bytes(self.getModel()), self.getCustomObjects()
        feature_cols = list(self.getFeatureColumns())
        loaded = []

        def predict(features):
            if not loaded:
                loaded.append(remote.model_from_bytes(model_bytes, custom_objects, compile=False))
            model = loaded[0]
            x = remote.model_inputs(model, dict(zip(feature_cols, features)), feature_cols)
            outputs = model.predict_on_batch(x)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            return [output if hasattr(output, "reshape") else output.numpy() for output in outputs]

        return predict


declare(KerasEstimator, {"custom_objects": ("custom objects for loading the model", None, None),
                         "backward_passes_per_step": ("batches whose gradients are summed before each allreduce",
                                                      None, None)})
declare(KerasModel, {"custom_objects": ("custom objects for loading the model", None, None)})
