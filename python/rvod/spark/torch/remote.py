"""What each rank of a TorchEstimator fit runs: read its share of the data, train with
``rvod.torch.DistributedOptimizer``, average the epoch's metrics over the ranks, and (rank 0) write a
checkpoint to the store after every epoch. Rank 0 returns ``(history, final checkpoint bytes)``."""

from __future__ import annotations

import io
from typing import Any


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _metric_name(metric: Any) -> str:
    return getattr(metric, "__name__", type(metric).__name__)


def train(settings: dict[str, Any], model, optimizer_cls, optimizer_state: dict[str, Any], loss, input_shapes,
          label_shapes, resume: dict[str, Any] | None) -> tuple[list[dict[str, Any]], bytes] | None:
    import torch

    import rvod.torch as hvd
    from rvod.spark.common.estimator import load_rank_data

    hvd.init()
    try:
        rank, size = hvd.rank(), hvd.size()
        if settings["random_seed"] is not None:
            torch.manual_seed(settings["random_seed"])
        optimizer = optimizer_cls(model.parameters(), lr=1.0)
        optimizer.load_state_dict(optimizer_state)
        history: list[dict[str, Any]] = []
        if resume is not None:
            model.load_state_dict(resume["model"])
            optimizer.load_state_dict(resume["optimizer"])
            history = list(resume.get("history", []))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        compression = settings["gradient_compression"] or hvd.Compression.none
        distributed = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                               compression=compression)
        batches, val = load_rank_data(settings, rank, size)
        label_cols, feature_cols = settings["label_cols"], settings["feature_cols"]
        losses = _as_list(loss)
        losses = losses * len(label_cols) if len(losses) == 1 else losses
        weights = settings["loss_weights"] or [1.0] * len(label_cols)
        metrics = settings["metrics"]
        weight_col = settings["sample_weight_col"]

        def tensors(batch):
            if settings["transformation_fn"] is not None:
                batch = settings["transformation_fn"](batch)
            inputs = [torch.from_numpy(batch[column]) for column in feature_cols]
            if input_shapes:
                inputs = [tensor.reshape(shape) for tensor, shape in zip(inputs, input_shapes)]
            labels = [torch.from_numpy(batch[column]) for column in label_cols]
            if label_shapes:
                labels = [tensor.reshape(shape) for tensor, shape in zip(labels, label_shapes)]
            sample_weights = torch.from_numpy(batch[weight_col]) if weight_col else None
            return inputs, labels, sample_weights

        def batch_loss(outputs, labels, sample_weights):
            total = 0.0
            for fn, weight, output, label in zip(losses, weights, outputs, labels):
                value = fn(output, label)
                if sample_weights is not None:
                    value = (value * sample_weights).mean()
                total = total + weight * value
            return total

        def measure(outputs, labels) -> list[float]:
            return [float(metric(output, label)) for metric in metrics for output, label in zip(outputs, labels)]

        names = ["loss"] + [_metric_name(metric) + (f"_{label}" if len(label_cols) > 1 else "")
                            for metric in metrics for label in label_cols]
        checkpoint = b""
        for epoch in range(len(history), settings["epochs"]):
            model.train()
            sums, rows = torch.zeros(len(names), dtype=torch.float64), 0
            for batch in batches.epoch(epoch):
                inputs, labels, sample_weights = tensors(batch)
                distributed.zero_grad()
                outputs = _as_list(model(*inputs))
                value = batch_loss(outputs, labels, sample_weights)
                value.backward()
                distributed.step()
                count = len(labels[0])
                with torch.no_grad():
                    sums += torch.tensor([float(value)] + measure(outputs, labels), dtype=torch.float64) * count
                rows += count
            totals = hvd.allreduce(torch.cat([sums, torch.tensor([float(rows)], dtype=torch.float64)]),
                                   op=hvd.Sum, name=f"rvod.spark.train_metrics.{epoch}")
            entry: dict[str, Any] = {"epoch": epoch,
                                     "train": dict(zip(names, (totals[:-1] / totals[-1]).tolist()))}
            if settings["val_path"] is not None:
                entry["validation"] = _validate(settings, model, val, tensors, batch_loss, measure, names, epoch,
                                                hvd, torch)
            history.append(entry)
            if rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                         "history": history}
                buffer = io.BytesIO()
                torch.save(state, buffer)
                checkpoint = buffer.getvalue()
                if settings["checkpoint_path"] is not None:
                    settings["store"].write(settings["checkpoint_path"], checkpoint)
                if settings["verbose"]:
                    print(f"epoch {epoch + 1}/{settings['epochs']}: " + ", ".join(
                        f"{part} {name} {value:.4f}" for part in ("train", "validation")
                        for name, value in entry.get(part, {}).items()), flush=True)
            for callback in settings["callbacks"]:
                callback(epoch, entry)
        if rank == 0 and not checkpoint:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "history": history},
                       buffer)
            checkpoint = buffer.getvalue()
        return (history, checkpoint) if rank == 0 else None
    finally:
        hvd.shutdown()


def _validate(settings, model, val, tensors, batch_loss, measure, names, epoch, hvd, torch) -> dict[str, float]:
    """The validation loss and metrics over every rank's validation rows."""
    from rvod.spark.common import data

    sums, rows = torch.zeros(len(names), dtype=torch.float64), 0
    model.eval()
    with torch.no_grad():
        if val is not None:
            for batch in data.validation_batches(val, settings["val_batch_size"],
                                                 settings["validation_steps_per_epoch"]):
                inputs, labels, sample_weights = tensors(batch)
                outputs = _as_list(model(*inputs))
                count = len(labels[0])
                sums += torch.tensor([float(batch_loss(outputs, labels, sample_weights))] + measure(outputs, labels),
                                     dtype=torch.float64) * count
                rows += count
    totals = hvd.allreduce(torch.cat([sums, torch.tensor([float(rows)], dtype=torch.float64)]), op=hvd.Sum,
                           name=f"rvod.spark.validation_metrics.{epoch}")
    return dict(zip(names, (totals[:-1] / max(float(totals[-1]), 1.0)).tolist()))
