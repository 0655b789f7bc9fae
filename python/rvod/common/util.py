"""Small helpers every shim's optimizer uses."""


def split_list(items, count):
    """``items`` in ``count`` consecutive chunks whose lengths differ by at most one (empty ones dropped),
    as tuples: how ``num_groups``/``groups=N`` spread parameters over fused groups."""
    base, extra = divmod(len(items), count)
    chunks, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        if end > start:
            chunks.append(tuple(items[start:end]))
        start = end
    return chunks
