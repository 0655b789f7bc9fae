"""NumPy references of the engine's compressed allreduces (src/ring/compressed), for one step from every
rank's values: the int8 and 1-bit block codecs (256 values a block for int8, 32 for 1-bit, a float32 scale each), their
reduce-scatter over units (at most 256 values, within one tensor) and allgather of the re-encoded sums, and PowerSGD's
orthonormalised factors. Written from the documented algorithm, not from the Rust code."""

import numpy as np

BLOCK = 256  # int8's block, and the unit of the chunks each rank reduces
ONEBIT_BLOCK = 32


def _round_half_away(x):
    return np.trunc(x + np.copysign(np.float32(0.5), x)).astype(np.float32)


def encode_decode(values, kind):
    """``values`` (float32) as they come back after one trip through the ``kind`` codec ("int8", "onebit")."""
    values = np.asarray(values, dtype=np.float32)
    out = np.empty_like(values)
    size = BLOCK if kind == "int8" else ONEBIT_BLOCK
    for start in range(0, values.size, size):
        block = values[start:start + size]
        if kind == "int8":
            scale = np.float32(np.abs(block).max() / np.float32(127.0)) if block.size else np.float32(0)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            q = np.clip(_round_half_away(block * inverse), -127, 127)
            out[start:start + size] = q * scale
        else:
            scale = np.float32(np.sqrt(np.square(block.astype(np.float64)).mean()))  # root mean square
            out[start:start + size] = np.where(block >= 0, scale, -scale)
    return out


def units(sizes):
    """The units of tensors of ``sizes`` values back to back: at most 256 values, never across a tensor's
    end. (Which rank reduces each unit changes nothing in the result: every rank sums in rank order.)"""
    found, start = [], 0
    for size in sizes:
        for at in range(start, start + size, BLOCK):
            found.append((at, min(at + BLOCK, start + size)))
        start += size
    return found


def _each_unit(values, units, kind):
    out = np.empty_like(values)
    for a, b in units:
        out[a:b] = encode_decode(values[a:b], kind)
    return out


def quantized_allreduce(contributions, kind, steps=1, sizes=None):
    """``steps`` steps of the int8 / 1-bit allreduce of every rank's float32 ``contributions`` (the same
    each step; tensors of ``sizes`` values back to back, one tensor by default), with error feedback: each
    rank adds what it could not send last time, and so does the rank that re-encodes each run's sum.
    Returns the last step's result, or every step's with ``steps > 1``, in the contributions' shape. Models
    the tensors the engine compresses (of 2+ dimensions and at least 1,024 values; smaller ones and vectors
    are summed exactly)."""
    shape = contributions[0].shape
    contributions = [c.reshape(-1) for c in contributions]
    n, total = len(contributions), contributions[0].size
    all_units = units(sizes or [total])
    worker = [np.zeros(total, dtype=np.float32) for _ in range(n)]
    server = np.zeros(total, dtype=np.float32)
    results = []
    for _ in range(steps):
        summed = np.zeros(total, dtype=np.float32)
        for rank, values in enumerate(contributions):  # rank order
            sent = values + worker[rank]
            decoded = _each_unit(sent, all_units, kind)
            worker[rank] = sent - decoded
            summed += decoded
        summed += server
        result = _each_unit(summed, all_units, "int8")  # the sums travel as int8 for either codec
        server = summed - result
        results.append(result.reshape(shape))
    return results if steps > 1 else results[0]


def low_rank(shape, rank, seed):
    """A ``shape`` float32 matrix of rank ``rank``."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((shape[0], rank)) @ rng.standard_normal((rank, shape[1]))).astype(np.float32)
