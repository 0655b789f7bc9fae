"""NumPy references of the engine's compressed allreduces (src/ring/compressed), for one step from every
rank's values: the int8 and 1-bit block codecs (256 values a block, a float32 scale each), their
reduce-scatter over chunks of whole blocks and allgather of the re-encoded sums, and PowerSGD's
orthonormalised factors. Written from the documented algorithm, not from the Rust code."""

import numpy as np

BLOCK = 256


def _round_half_away(x):
    return np.trunc(x + np.copysign(np.float32(0.5), x)).astype(np.float32)


def encode_decode(values, kind):
    """``values`` (float32) as they come back after one trip through the ``kind`` codec ("int8", "onebit")."""
    values = np.asarray(values, dtype=np.float32)
    out = np.empty_like(values)
    for start in range(0, values.size, BLOCK):
        block = values[start:start + BLOCK]
        if kind == "int8":
            scale = np.float32(np.abs(block).max() / np.float32(127.0)) if block.size else np.float32(0)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            q = np.clip(_round_half_away(block * inverse), -127, 127)
            out[start:start + BLOCK] = q * scale
        else:
            scale = np.float32(np.abs(block).astype(np.float64).mean())
            out[start:start + BLOCK] = np.where(block >= 0, scale, -scale)
    return out


def chunks(total, n):
    """The element range each of ``n`` ranks reduces: whole blocks, split as evenly as they go."""
    blocks = -(-total // BLOCK)
    base, extra = divmod(blocks, n)
    ranges, first = [], 0
    for rank in range(n):
        count = base + (rank < extra)
        ranges.append((min(first * BLOCK, total), min((first + count) * BLOCK, total)))
        first += count
    return ranges


def quantized_allreduce(contributions, kind, steps=1):
    """``steps`` steps of the int8 / 1-bit allreduce of every rank's float32 ``contributions`` (the same
    each step), with error feedback: each rank adds what it could not send last time, and so does the rank
    that re-encodes each chunk's sum. Returns the last step's result, or every step's with ``steps > 1``."""
    n, total = len(contributions), contributions[0].size
    worker = [np.zeros(total, dtype=np.float32) for _ in range(n)]
    server = np.zeros(total, dtype=np.float32)
    results = []
    for _ in range(steps):
        result = np.empty(total, dtype=np.float32)
        for start, end in chunks(total, n):
            summed = np.zeros(end - start, dtype=np.float32)
            for rank, values in enumerate(contributions):  # rank order
                sent = values[start:end] + worker[rank][start:end]
                decoded = encode_decode(sent, kind)
                worker[rank][start:end] = sent - decoded
                summed += decoded
            summed += server[start:end]
            result[start:end] = encode_decode(summed, kind)
            server[start:end] = summed - result[start:end]
        results.append(result)
    return results if steps > 1 else results[0]


def low_rank(shape, rank, seed):
    """A ``shape`` float32 matrix of rank ``rank``."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((shape[0], rank)) @ rng.standard_normal((rank, shape[1]))).astype(np.float32)
