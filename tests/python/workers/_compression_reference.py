"""NumPy references of the engine's compressed allreduces (src/ring/compressed), for one step from every
rank's values: the int8 and 1-bit block codecs (256 values a block for int8, 32 for 1-bit, a float32 scale each), their
reduce-scatter over units (at most 256 values, within one tensor, each reduced by a rank its name and place choose)
and allgather of the re-encoded sums, and PowerSGD's
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


def _name_seed(name):
    """FNV-1a (64 bits) of the tensor's name: where its units start being dealt out to the ranks."""
    h = 0xCBF29CE484222325
    for byte in name.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def units(total, name, n):
    """The units of one tensor of ``total`` values on ``n`` ranks: runs of at most 256 values, the ``k``-th
    reduced by rank ``(seed + k) mod n``, ``seed`` a hash of the tensor's name."""
    seed = _name_seed(name)
    return [(at, min(at + BLOCK, total), ((seed + k) & 0xFFFFFFFFFFFFFFFF) % n)
            for k, at in enumerate(range(0, total, BLOCK))]


def quantized_allreduce(contributions, kind, name, steps=1):
    """``steps`` steps of the int8 / 1-bit allreduce of every rank's float32 ``contributions`` to the tensor
    the engine calls ``name`` (the same values each step), with error feedback: each rank encodes its
    values plus what it could not send last time, except in the units it reduces itself, which it adds
    exactly (they never travel); the reducing rank sums in rank order, adds what it could not send of the
    last sum, and encodes the sum as int8 for every rank. Returns the last step's result, or every step's
    with ``steps > 1``, in the contributions' shape. Models the tensors the engine compresses (of 2+
    dimensions and at least 1,024 values; smaller ones and vectors are summed exactly)."""
    shape = contributions[0].shape
    contributions = [c.reshape(-1) for c in contributions]
    n, total = len(contributions), contributions[0].size
    all_units = units(total, name, n)
    worker = [np.zeros(total, dtype=np.float32) for _ in range(n)]
    server = np.zeros(total, dtype=np.float32)
    results = []
    for _ in range(steps):
        summed = np.zeros(total, dtype=np.float32)
        for rank, values in enumerate(contributions):  # rank order
            sent = values + worker[rank]
            decoded = sent.copy()
            for a, b, owner in all_units:
                if owner != rank:
                    decoded[a:b] = encode_decode(sent[a:b], kind)
            worker[rank] = sent - decoded
            summed += decoded
        summed += server
        result = np.empty_like(summed)
        for a, b, _ in all_units:  # the sums travel as int8 for either codec
            result[a:b] = encode_decode(summed[a:b], "int8")
        server = summed - result
        results.append(result.reshape(shape))
    return results if steps > 1 else results[0]


def low_rank(shape, rank, seed):
    """A ``shape`` float32 matrix of rank ``rank``."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((shape[0], rank)) @ rng.standard_normal((rank, shape[1]))).astype(np.float32)
