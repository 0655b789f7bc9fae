"""Expected results that every framework's worker computes the same way, on its own tensor type."""


def alltoall_blocks(rank_input, splits_matrix, receiver):
    """The blocks rank ``receiver`` gets in an alltoall, in sender order: sender ``s`` sends rows of its input
    ``rank_input(s)`` to the ranks in rank order, ``splits_matrix[s][r]`` rows to rank ``r``."""
    blocks = []
    for sender, splits in enumerate(splits_matrix):
        offset = sum(splits[:receiver])
        blocks.append(rank_input(sender)[offset:offset + splits[receiver]])
    return blocks
