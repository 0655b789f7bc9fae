"""Gradient compression: what a tensor is turned into before it is sent, and back after it is reduced.

``Compression.none`` sends tensors as they are; ``Compression.fp16`` (as in Horovod) and
``Compression.bf16`` (rvod's addition: float32's range, so no overflow) send floating-point tensors at
half the width. Integer and bool tensors always pass through unchanged.
"""

import torch

from rvod.common.compression import Compressor, NoneCompressor


class _CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype`` for the trip and back to their own dtype after."""

    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors, by the names scripts use: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
