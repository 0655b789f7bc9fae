"""Gradient compression written once for every framework: what a tensor is turned into before it is sent,
and back after it is reduced.

``NoneCompressor`` sends tensors as they are. A ``CastCompressor`` sends floating-point tensors as
``wire_dtype`` (half the width for float16 and bfloat16) and casts the result back; integer and bool
tensors pass through unchanged. A shim subclasses it with its own ``is_floating`` and ``cast``.

An ``EngineCompressor`` (``Compression.int8``, ``.onebit``, ``.powersgd(rank=4)``) changes nothing in
Python: the engine compresses the fused buffers of Sum and Average allreduces of floating-point tensors, with
error feedback per tensor name (docs/compression.md); ``engine_code(compression, tensors)`` is the code an
op passes to it (0: none, also for a group with a tensor that is not floating-point, which travels exactly
as the fp16 compressor would leave it).
"""

# The engine's compression codes (src/types.rs, Compression::code): the kind in the low byte, PowerSGD's rank
# in the high byte.
_INT8, _ONEBIT, _POWERSGD = 1, 2, 3


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


class EngineCompressor(NoneCompressor):
    """Leaves tensors as they are in Python; the engine compresses them (``engine_code`` says how)."""

    engine_code = 0

    @staticmethod
    def is_floating(tensor):
        raise NotImplementedError


class PowerSGDCompressor(EngineCompressor):
    """PowerSGD at ``rank`` (``Compression.powersgd(rank=4)``): matrices travel as two rank-``rank`` factors."""

    def __init__(self, rank=4):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 255:
            raise ValueError(f"powersgd rank must be an integer from 1 to 255, got {rank!r}")
        self.rank = rank
        self.engine_code = _POWERSGD | rank << 8

    def __repr__(self):
        return f"Compression.powersgd(rank={self.rank})"

    def __eq__(self, other):
        return type(other) is type(self) and other.rank == self.rank

    def __hash__(self):
        return hash((type(self), self.rank))


def engine_code(compression, tensors):
    """The engine's compression code for an allreduce of ``tensors`` with ``compression``: 0 unless it is an
    engine compressor and every tensor is floating-point."""
    code = getattr(compression, "engine_code", 0)
    if code and all(compression.is_floating(t) for t in tensors):
        return code
    return 0


def compressors(module, is_floating, cast, float16, bfloat16):
    """A framework's ``FP16Compressor``, ``BF16Compressor`` and ``Compression`` namespace (``none``,
    ``fp16``, ``bf16``, ``int8``, ``onebit``, ``powersgd(rank=4)``), given how it tells floating-point tensors
    (``is_floating(tensor)``) and casts (``cast(tensor, dtype)``); ``module`` is where the shim binds them
    (for pickling and messages)."""
    floating = staticmethod(is_floating)
    base = type("CastCompressor", (CastCompressor,), {"is_floating": floating,
                                                      "cast": staticmethod(cast), "__module__": module})
    fp16 = type("FP16Compressor", (base,), {"wire_dtype": float16, "__module__": module,
                                            "__doc__": "Sends floating-point tensors as float16."})
    bf16 = type("BF16Compressor", (base,), {"wire_dtype": bfloat16, "__module__": module,
                                            "__doc__": "Sends floating-point tensors as bfloat16."})
    int8 = type("Int8Compressor", (EngineCompressor,), {
        "engine_code": _INT8, "is_floating": floating, "__module__": module,
        "__doc__": "The engine sends floating-point values as int8 blocks with a scale each, with error feedback."})
    onebit = type("OneBitCompressor", (EngineCompressor,), {
        "engine_code": _ONEBIT, "is_floating": floating, "__module__": module,
        "__doc__": "The engine sends the signs of floating-point values with a scale per block, with error "
                   "feedback."})
    powersgd_type = type("PowerSGDCompressor", (PowerSGDCompressor,), {"is_floating": floating,
                                                                      "__module__": module})

    def powersgd(rank=4):
        """PowerSGD: the engine sends each matrix as two rank-``rank`` factors, with error feedback."""
        return powersgd_type(rank=rank)

    namespace = type("Compression", (), {
        "none": NoneCompressor, "fp16": fp16, "bf16": bf16, "int8": int8, "onebit": onebit,
        "powersgd": staticmethod(powersgd), "__module__": module,
        "__doc__": "The compressors, by the names scripts use: ``Compression.none``, ``.fp16``, ``.bf16``, "
                   "``.int8``, ``.onebit``, ``.powersgd(rank=4)``."})
    return fp16, bf16, namespace
