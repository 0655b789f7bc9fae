"""Gradient compression for NDArrays: what a gradient is turned into before it is sent, and back after.

``Compression.none`` sends NDArrays as they are; ``Compression.fp16`` (as in Horovod) sends float32 and
float64 NDArrays as float16 and casts the result back. Other dtypes pass through unchanged.
"""

import numpy as np

from rvod.common.compression import Compressor, NoneCompressor

_WIDE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class FP16Compressor(Compressor):
    """Sends float32 and float64 NDArrays as float16."""

    @staticmethod
    def compress(tensor):
        if np.dtype(tensor.dtype) in _WIDE_FLOATS:
            return tensor.astype(np.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.astype(ctx)


class Compression:
    """The compressors, by the names scripts use: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
