"""``TorchEstimator`` and ``TorchModel``: horovod.spark.torch's API."""

from __future__ import annotations

import copy
import io

from pyspark import keyword_only

from rvod.spark.common.estimator import HorovodEstimator, HorovodModel
from rvod.spark.common.params import declare
from rvod.spark.torch import remote


class TorchEstimator(HorovodEstimator):
    """Spark Estimator fitting a PyTorch model to a DataFrame on ``num_proc`` ranks.

    The params are Horovod's (``rvod.spark.common.params``) plus ``input_shapes`` (a shape per feature
    column, ``-1`` for the batch, e.g. ``[[-1, 1, 8, 8]]``). ``optimizer`` is a torch optimizer over
    ``model``'s parameters (its class and state travel to the ranks); ``loss`` takes ``(output, label)``,
    one per label column or one for all; ``metrics`` are functions ``(output, label) -> number``, recorded
    per epoch in the model's history; ``callbacks`` are called on every rank as ``callback(epoch, logs)``
    after each epoch. After every epoch rank 0 writes ``{'model', 'optimizer', 'epoch', 'history'}``
    (``torch.save``) to the store's checkpoint of the run; a fit with the ``run_id`` of a run that has a
    checkpoint resumes after its last epoch.
    """

    run_id_prefix = "pytorch"

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None, loss=None,
                 metrics=None, loss_weights=None, sample_weight_col=None, gradient_compression=None,
                 feature_cols=None, input_shapes=None, validation=None, label_cols=None, callbacks=None,
                 batch_size=None, val_batch_size=None, epochs=None, verbose=1, random_seed=None, shuffle=True,
                 partitions_per_process=None, run_id=None, train_steps_per_epoch=None,
                 validation_steps_per_epoch=None, transformation_fn=None, label_shapes=None):
        super().__init__()
        self._setDefault(input_shapes=None)
        self._set(**{key: value for key, value in self._input_kwargs.items() if value is not None})

    def _fit_on_prepared_data(self, backend, prepared, run_id):
        import torch

        store = self.getStore()
        resume = None
        path = store.get_checkpoint_path(run_id)
        if path is not None and store.exists(path):
            resume = torch.load(io.BytesIO(store.read(path)), map_location="cpu", weights_only=False)
            if self.getVerbose():
                print(f"rvod.spark: resuming run {run_id} after epoch {resume['epoch'] + 1} from {path}")
        model, optimizer = self.getModel(), self.getOptimizer()
        if optimizer is None or self.getLoss() is None:
            raise ValueError("rvod.spark: TorchEstimator needs an optimizer and a loss")
        settings = self.training_settings(prepared, run_id)
        results = backend.run(remote.train, args=(
            settings, model, type(optimizer), optimizer.state_dict(), self.getLoss(), self.getInputShapes(),
            self.getLabelShapes(), resume))
        history, checkpoint = results[0]
        state = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=False)
        trained = copy.deepcopy(model)
        trained.load_state_dict(state["model"])
        trained.eval()
        trained_optimizer = type(optimizer)(trained.parameters(), lr=1.0)
        trained_optimizer.load_state_dict(state["optimizer"])
        return TorchModel(history=history, model=trained, feature_columns=self.getFeatureCols(),
                          label_columns=self.getLabelCols(), optimizer=trained_optimizer, run_id=run_id,
                          input_shapes=self.getInputShapes(), loss=self.getLoss(), _metadata=prepared.metadata)


class TorchModel(HorovodModel):
    """Spark Transformer around a trained PyTorch model (``getModel()``); ``transform(df)`` adds a
    ``<label>__output`` column per label column."""

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, input_shapes=None, label_columns=None,
                 optimizer=None, run_id=None, _metadata=None, loss=None):
        super().__init__()
        self._setDefault(optimizer=None, input_shapes=None, loss=None)
        self._set(**{key: value for key, value in self._input_kwargs.items() if value is not None})

    def _predict_fn(self):
        model, input_shapes = self.getModel(), self.getInputShapes()

        def predict(features):
            import torch

            inputs = [torch.from_numpy(array) for array in features]
            if input_shapes:
                inputs = [tensor.reshape(shape) for tensor, shape in zip(inputs, input_shapes)]
            model.eval()
            with torch.no_grad():
                outputs = model(*inputs)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            return [output.numpy() for output in outputs]

        return predict


declare(TorchEstimator, {"input_shapes": ("shape of each feature column's tensor", None, None)})
declare(TorchModel, {"optimizer": ("the optimizer, with its state after training", None, None),
                     "input_shapes": ("shape of each feature column's tensor", None, None),
                     "loss": ("the loss trained with", None, None)})
