"""Gradient compression written once for every framework: what a tensor is turned into before it is sent,
and back after it is reduced.

``NoneCompressor`` sends tensors as they are. A ``CastCompressor`` sends floating-point tensors as
``wire_dtype`` (half the width for float16 and bfloat16) and casts the result back; integer and bool
tensors pass through unchanged. A shim subclasses it with its own ``is_floating`` and ``cast``.
"""


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype`` for the trip and back to their own dtype after."""

    wire_dtype = None

    @staticmethod
    def is_floating(tensor):
        raise NotImplementedError

    @staticmethod
    def cast(tensor, dtype):
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        if cls.is_floating(tensor):
            return cls.cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls.cast(tensor, ctx)


def compressors(module, is_floating, cast, float16, bfloat16):
    """A framework's ``FP16Compressor``, ``BF16Compressor`` and ``Compression`` namespace (``none``,
    ``fp16``, ``bf16``), given how it tells floating-point tensors (``is_floating(tensor)``) and casts
    (``cast(tensor, dtype)``); ``module`` is where the shim binds them (for pickling and messages)."""
    base = type("CastCompressor", (CastCompressor,), {"is_floating": staticmethod(is_floating),
                                                      "cast": staticmethod(cast), "__module__": module})
    fp16 = type("FP16Compressor", (base,), {"wire_dtype": float16, "__module__": module,
                                            "__doc__": "Sends floating-point tensors as float16."})
    bf16 = type("BF16Compressor", (base,), {"wire_dtype": bfloat16, "__module__": module,
                                            "__doc__": "Sends floating-point tensors as bfloat16."})
    namespace = type("Compression", (), {
        "none": NoneCompressor, "fp16": fp16, "bf16": bf16, "__module__": module,
        "__doc__": "The compressors, by the names scripts use: ``Compression.none``, ``.fp16``, ``.bf16``."})
    return fp16, bf16, namespace
