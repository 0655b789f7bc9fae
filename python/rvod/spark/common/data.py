"""From a DataFrame to each rank's training batches: Spark writes Parquet into the store, each rank reads
its share of the row groups with pyarrow.

Not Petastorm (Horovod's reader): its last release (0.13.1) installs on Python 3.11 but cannot be imported
with pyarrow 16 or later (it imports ``pyarrow.filesystem``, which pyarrow removed), and it is no longer
maintained. Parquet read by pyarrow needs nothing beyond what Spark's pandas support already needs.

Rank ``r`` of ``n`` reads row groups ``r, r + n, r + 2n, ...`` (in file order) into memory; the DataFrame is
written as ``num_proc * partitions_per_process`` files, so each rank gets a share even of small data. Every
rank runs the same number of steps per epoch (``train_steps_per_epoch``, default rows / (batch_size * n)),
cycling through its rows, so the ranks' collectives always match.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WHERE = "rvod.spark"


@dataclass
class PreparedData:
    """Where a fit's data went in the store, how many rows, and each column's metadata."""

    train_path: str
    val_path: str | None
    train_rows: int
    val_rows: int
    metadata: dict[str, dict[str, Any]]


def column_metadata(df, columns: Sequence[str]) -> dict[str, dict[str, Any]]:
    """For each column: its Spark type's name, whether it is a vector or array, and its element count (None for
    a scalar), taken from the first row."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import ArrayType

    first = df.select(*columns).first()
    if first is None:
        raise ValueError(f"{WHERE}: the DataFrame to fit on has no rows")
    metadata = {}
    for column in columns:
        data_type = df.schema[column].dataType
        if isinstance(data_type, VectorUDT):
            kind, shape = "vector", int(first[column].size)
        elif isinstance(data_type, ArrayType):
            kind, shape = "array", len(first[column])
        else:
            kind, shape = "scalar", None
        metadata[column] = {"spark_data_type": type(data_type).__name__, "spark_type_json": data_type.json(),
                            "kind": kind, "shape": shape}
    return metadata


def prepare_data(df, store, feature_cols: Sequence[str], label_cols: Sequence[str], validation: Any,
                 sample_weight_col: str | None, num_files: int, seed: int | None) -> PreparedData:
    """Write the columns the model needs to the store's train (and validation) paths as Parquet: vectors
    become arrays of doubles; ``validation`` is a fraction of rows chosen at random or a column that is
    1/True for validation rows."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    columns = list(feature_cols) + list(label_cols) + ([sample_weight_col] if sample_weight_col else [])
    missing = [column for column in columns + ([validation] if isinstance(validation, str) else [])
               if column not in df.columns]
    if missing:
        raise ValueError(f"{WHERE}: columns {missing} are not in the DataFrame (its columns: {df.columns})")
    metadata = column_metadata(df, columns)
    selected = [vector_to_array(F.col(c), "float64").alias(c) if metadata[c]["kind"] == "vector" else F.col(c)
                for c in columns]
    if isinstance(validation, str):
        flag = F.col(validation).cast("boolean")
        train_df, val_df = df.where(~flag).select(*selected), df.where(flag).select(*selected)
    elif validation:
        if not 0 < float(validation) < 1:
            raise ValueError(f"{WHERE}: validation must be a fraction in (0, 1) or a column name, got {validation!r}")
        train_df, val_df = df.select(*selected).randomSplit([1 - float(validation), float(validation)],
                                                            seed=seed if seed is not None else 0)
    else:
        train_df, val_df = df.select(*selected), None
    train_path = store.get_train_data_path()
    train_df.repartition(num_files).write.mode("overwrite").parquet(store.get_full_path(train_path))
    train_rows = _parquet_rows(store, train_path)
    if train_rows == 0:
        raise ValueError(f"{WHERE}: no training rows are left after taking the validation rows out")
    val_path, val_rows = None, 0
    if val_df is not None:
        val_path = store.get_val_data_path()
        val_df.repartition(num_files).write.mode("overwrite").parquet(store.get_full_path(val_path))
        val_rows = _parquet_rows(store, val_path)
    return PreparedData(train_path, val_path, train_rows, val_rows, metadata)


def _row_groups(filesystem, path: str) -> list[tuple[Any, int, int]]:
    """``(ParquetFile, row group index, rows)`` of every row group under ``path``, in file name order."""
    import pyarrow.parquet as pq
    from pyarrow import fs

    infos = filesystem.get_file_info(fs.FileSelector(path, recursive=True))
    names = sorted(info.path for info in infos
                   if info.type == fs.FileType.File and info.path.endswith(".parquet")
                   and not info.base_name.startswith(("_", ".")))
    groups = []
    for name in names:
        parquet = pq.ParquetFile(filesystem.open_input_file(name))
        groups.extend((parquet, index, parquet.metadata.row_group(index).num_rows)
                      for index in range(parquet.metadata.num_row_groups))
    return groups


def _parquet_rows(store, path: str) -> int:
    return sum(rows for _, _, rows in _row_groups(store.get_filesystem(), path))


def as_model_array(values: np.ndarray) -> np.ndarray:
    """Floating data as float32 (what models compute in), integers as int64, booleans as float32."""
    if values.dtype.kind in "fb":
        return values.astype(np.float32, copy=False)
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    return values


def _column_to_numpy(column) -> np.ndarray:
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        rows = len(column)
        values = column.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(rows, -1) if rows else values.reshape(0, 0)
    return column.to_numpy(zero_copy_only=False)


def read_shard(store, path: str, rank: int, size: int, columns: Sequence[str],
               allow_empty: bool = False) -> dict[str, np.ndarray] | None:
    """Rank ``rank``'s share of the Parquet data at ``path``: row groups ``rank, rank + size, ...``, as a
    NumPy array per column (arrays and vectors become 2-D); None for no rows when ``allow_empty``."""
    import pyarrow as pa

    groups = _row_groups(store.get_filesystem(), path)
    mine = groups[rank::size]
    if not any(rows for _, _, rows in mine):
        if allow_empty:
            return None
        raise ValueError(f"{WHERE}: rank {rank} of {size} has no rows to train on: {path} has {len(groups)} row "
                         f"groups of {sum(rows for _, _, rows in groups)} rows; give it more rows or fewer ranks")
    table = pa.concat_tables([parquet.read_row_group(index, columns=list(columns)) for parquet, index, _ in mine])
    # Copies: Arrow's buffers are read-only, and frameworks warn about (or refuse) read-only arrays.
    return {column: np.array(as_model_array(_column_to_numpy(table.column(column)))) for column in columns}


class Batches:
    """Batches of a rank's rows: ``steps`` of ``batch_size`` rows per epoch, cycling through the rows (shuffled
    each epoch when ``shuffle``), so that every rank runs as many steps as the others."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, steps: int, shuffle: bool, seed: int):
        self.arrays = arrays
        self.rows = len(next(iter(arrays.values())))
        self.batch_size = batch_size
        self.steps = steps
        self.shuffle = shuffle
        self.seed = seed

    def epoch(self, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        needed = self.steps * self.batch_size
        rng = np.random.default_rng(self.seed + epoch)
        rounds = max(1, math.ceil(needed / self.rows))
        order = np.concatenate([rng.permutation(self.rows) if self.shuffle else np.arange(self.rows)
                                for _ in range(rounds)])[:needed]
        for step in range(self.steps):
            chosen = order[step * self.batch_size:(step + 1) * self.batch_size]
            yield {column: values[chosen] for column, values in self.arrays.items()}


def steps_per_epoch(rows: int, batch_size: int, size: int, given: int | None) -> int:
    """Horovod's default: the rows of all ranks, once per epoch, at least one step."""
    return given if given else max(1, rows // (batch_size * size))


def validation_batches(arrays: dict[str, np.ndarray], batch_size: int,
                       steps: int | None) -> Iterator[dict[str, np.ndarray]]:
    """A rank's validation rows in order, ``batch_size`` at a time (``steps`` batches at most)."""
    rows = len(next(iter(arrays.values())))
    for index, first in enumerate(range(0, rows, batch_size)):
        if steps is not None and index >= steps:
            return
        yield {column: values[first:first + batch_size] for column, values in arrays.items()}
