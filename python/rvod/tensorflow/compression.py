"""Gradient compression for TensorFlow tensors: ``Compression.none``, ``Compression.fp16`` (as in Horovod)
and ``Compression.bf16`` (rvod's addition). Integer and bool tensors pass through unchanged; the logic
lives in ``rvod.common.compression``.
``Compression.int8``, ``.onebit`` and ``.powersgd(rank=4)`` are compressed by the engine, with error feedback
(docs/compression.md)."""

import tensorflow as tf

from rvod.common.compression import Compressor, NoneCompressor, compressors  # noqa: F401


FP16Compressor, BF16Compressor, Compression = compressors(
    __name__, lambda tensor: tensor.dtype.is_floating,
    tf.cast, tf.float16, tf.bfloat16)
