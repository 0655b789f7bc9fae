"""Expected results that every framework's worker computes the same way, on its own tensor type."""


def alltoall_blocks(rank_input, splits_matrix, receiver):
    """The blocks rank ``receiver`` gets in an alltoall, in sender order: sender ``s`` sends rows of its input
    ``rank_input(s)`` to the ranks in rank order, ``splits_matrix[s][r]`` rows to rank ``r``."""
    blocks = []
    for sender, splits in enumerate(splits_matrix):
        offset = sum(splits[:receiver])
        blocks.append(rank_input(sender)[offset:offset + splits[receiver]])
    return blocks


# Small factors for Product tests, signed and unsigned: their products stay exact in every dtype.
PRODUCT_VALUES = {True: [1, -2, 2, -1, 1, 3, -1], False: [1, 2, 3, 1, 2]}


def contribution(dtype, shape, rank, seed=0, product=False, *, n):
    """What `rank` of `n` contributes, as a NumPy array: for Product small factors, otherwise
    base + n * ((rank + i) % n), whose sum over ranks is n * base + n * n * (n - 1) / 2 (a multiple of n) and
    whose min and max come from different ranks for different elements."""
    import numpy as np

    count = int(np.prod(shape, dtype=np.int64))
    i = np.arange(count, dtype=np.int64)
    if dtype is np.bool_:
        values = (i + seed + rank) % 3 == 0
    elif product:
        table = np.array(PRODUCT_VALUES[np.dtype(dtype).kind != "u"])
        values = table[(i + seed + 2 * rank) % len(table)]
    else:
        base = (i * 5 + seed) % 11
        if np.dtype(dtype).kind != "u":
            base = base - 5
        values = base + n * ((rank + i) % n)
    return values.astype(dtype).reshape(shape)
