"""Gradient compression for torch tensors: ``Compression.none`` sends tensors as they are;
``Compression.fp16`` (as in Horovod) and ``Compression.bf16`` (rvod's addition: float32's range, so no
overflow) send floating-point tensors at half the width. Integer and bool tensors always pass through
unchanged. ``Compression.int8``, ``.onebit`` and ``.powersgd(rank=4)`` are compressed by the engine, with
error feedback (docs/compression.md). The logic lives in ``rvod.common.compression``.
"""

import torch

from rvod.common.compression import Compressor, NoneCompressor, compressors  # noqa: F401


FP16Compressor, BF16Compressor, Compression = compressors(
    __name__, lambda tensor: tensor.dtype.is_floating_point,
    lambda tensor, dtype: tensor.to(dtype), torch.float16, torch.bfloat16)
