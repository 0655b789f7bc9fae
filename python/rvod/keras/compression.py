"""Gradient compression for Keras 3 tensors of any backend (casts through ``keras.ops``):
``Compression.none``, ``.fp16`` (as in Horovod) and ``.bf16``. The logic lives in ``rvod.common.compression``.
``Compression.int8``, ``.onebit`` and ``.powersgd(rank=4)`` are compressed by the engine, with error feedback
(docs/compression.md)."""

import keras

from rvod.common.compression import Compressor, NoneCompressor, compressors  # noqa: F401


FP16Compressor, BF16Compressor, Compression = compressors(
    __name__, lambda tensor: keras.backend.is_float_dtype(keras.backend.standardize_dtype(tensor.dtype)),
    lambda tensor, dtype: keras.ops.cast(tensor, keras.backend.standardize_dtype(dtype)), "float16", "bfloat16")
