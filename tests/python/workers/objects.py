"""broadcast_object and allgather_object of the shim named on the command line (numpy, torch, tensorflow or
mxnet), run by rvodrun with 3 ranks: objects from 0 bytes to over 1 MiB (sizes around 255/256 and 64 KiB
included, where a size sent in a too narrow integer would wrap), from every root, named and unnamed, on a
process set without rank 0; for tensorflow also inside a TensorFlow 1 graph and refused inside tf.function.
"""

import importlib
import sys

import numpy as np
from _check import check, expect_error, finish

FRAMEWORK = sys.argv[1]
hvd = importlib.import_module(f"rvod.{FRAMEWORK}")
LATER_RANKS = hvd.ProcessSet([1, 2])
hvd.init(process_sets=[LATER_RANKS])
R, N = hvd.rank(), hvd.size()
assert N == 3, "run with 3 ranks"

# Pickled sizes land just around these (the blob dominates): 0-255, 256-65535 and above 64 KiB.
BLOB_SIZES = [0, 1, 200, 255, 256, 257, 1000, 65_535, 65_536, 65_537, 300_000, 1_048_579]


def blob(owner, length):
    """Bytes that differ per owner and length, so a mix-up or a truncation changes the value."""
    return np.random.default_rng([owner, length]).bytes(length)


with check(f"{FRAMEWORK}: broadcast_object of objects of every size, from every root"):
    for length in BLOB_SIZES:
        for root in range(N):
            expected = {"root": root, "blob": blob(root, length)}
            got = hvd.broadcast_object(expected if R == root else None, root_rank=root)
            assert got == expected, f"root {root}, {length} bytes: got {len(got['blob'])} bytes"

with check(f"{FRAMEWORK}: allgather_object of objects of different sizes on each rank, in rank order"):
    for length in BLOB_SIZES:
        got = hvd.allgather_object((R, blob(R, length + 1000 * R)))
        assert got == [(r, blob(r, length + 1000 * r)) for r in range(N)], f"{length} bytes"

with check(f"{FRAMEWORK}: named calls; a 2 MiB float64 array keeps its dtype, shape and values"):
    array = np.arange(256 * 1024, dtype=np.float64).reshape(512, 512) * (R + 1)
    got = hvd.broadcast_object(array, root_rank=N - 1, name="large.array")
    assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (512, 512), (type(got), got.dtype)
    assert np.array_equal(got, array / (R + 1) * N)
    gathered = hvd.allgather_object(array[:R + 1], name="large.rows")
    assert [g.shape for g in gathered] == [(1, 512), (2, 512), (3, 512)]
    assert all(np.array_equal(g, np.arange(512 * (r + 1), dtype=np.float64).reshape(r + 1, 512) * (r + 1))
               for r, g in enumerate(gathered))

with check(f"{FRAMEWORK}: broadcast_object and allgather_object on a process set without rank 0"):
    if R in (1, 2):
        got = hvd.broadcast_object({"blob": blob(2, 70_000)} if R == 2 else None, root_rank=2,
                                   process_set=LATER_RANKS)
        assert got == {"blob": blob(2, 70_000)}
        assert hvd.allgather_object(blob(R, 70_000 + R), process_set=LATER_RANKS) == [blob(1, 70_001),
                                                                                     blob(2, 70_002)]

if FRAMEWORK == "tensorflow":
    import tensorflow as tf

    with check("tensorflow: the object helpers run at once inside a TensorFlow 1 graph, as Horovod's do"):
        with tf.compat.v1.Graph().as_default():
            got = hvd.broadcast_object({"blob": blob(0, 80_000)} if R == 0 else None, root_rank=0)
            assert got == {"blob": blob(0, 80_000)}
            assert hvd.allgather_object(R, name="in.graph") == list(range(N))
            broadcast = hvd.broadcast_object_fn(root_rank=1, name="in.graph.fn")
            assert broadcast(("from", R)) == ("from", 1)

    with check("tensorflow: inside tf.function they are refused with a RuntimeError naming the helper"):
        @tf.function
        def in_function():
            return hvd.broadcast_object(1)

        expect_error(RuntimeError, "broadcast_object exchanges Python objects when it is called; call it "
                     "outside tf.function", in_function)

finish(R)
