"""Reduce-scatters and allgathers on one host, where shared memory stages them: exact values for uneven
first dimensions, tensors of fewer rows than ranks, scale factors, grouped and burst submissions fused, and
every dtype kind. The test reads the timeline to see which ran staged."""

import numpy as np
import rvod.numpy as hvd
from _check import check, finish

hvd.init()
R, N = hvd.rank(), hvd.size()


def rows(n, rank):
    """Rank ``rank``'s rows of a reduce-scatter of ``n`` rows: the first ``n % N`` ranks take one more."""
    start = rank * (n // N) + min(rank, n % N)
    return slice(start, start + n // N + (1 if rank < n % N else 0))


def contribution(rank, shape, dtype):
    return (np.arange(np.prod(shape), dtype=np.int64).reshape(shape) % 1000 * (rank + 1)).astype(dtype)


with check("allgather with a different first dimension per rank"):
    for dtype in (np.float32, np.int64, np.uint8):
        mine = np.full((R * 700 + 1, 64), R + 1, dtype=dtype)
        out = hvd.allgather(mine, name=f"ag.uneven.{np.dtype(dtype).name}")
        want = np.concatenate([np.full((r * 700 + 1, 64), r + 1, dtype=dtype) for r in range(N)])
        assert out.dtype == want.dtype and out.shape == want.shape and np.array_equal(out, want)

with check("allgather of 2 MiB per rank, and of an empty block"):
    mine = np.arange(1 << 18, dtype=np.float64) + R * 1e6
    assert np.array_equal(hvd.allgather(mine, name="ag.large"), np.concatenate([mine - R * 1e6 + r * 1e6
                                                                                    for r in range(N)]))
    empty = np.zeros((0 if R == 1 else 3, 5), dtype=np.float32) + R
    want = np.concatenate([np.zeros((0 if r == 1 else 3, 5), dtype=np.float32) + r for r in range(N)])
    assert np.array_equal(hvd.allgather(empty, name="ag.empty"), want)

with check("reducescatter of a large tensor, float32 and int32"):
    shape = (3001, 256)
    for dtype in (np.float32, np.int32):
        total = sum(contribution(r, shape, dtype) for r in range(N))
        out = hvd.reducescatter(contribution(R, shape, dtype), op=hvd.Sum, name=f"rs.sum.{np.dtype(dtype).name}")
        assert out.dtype == dtype and np.array_equal(out, total[rows(shape[0], R)])

with check("reducescatter average with prescale and postscale factors"):
    shape = (1 << 12, 64)
    out = hvd.reducescatter(contribution(R, shape, np.float64), op=hvd.Average, name="rs.avg",
                            prescale_factor=2.0, postscale_factor=0.25)
    want = sum(contribution(r, shape, np.float64) for r in range(N)) * 2.0 / N * 0.25
    assert np.allclose(out, want[rows(shape[0], R)], rtol=1e-12)

with check("grouped reducescatter: a large tensor, one of fewer rows than ranks, a vector"):
    shapes = [(1 << 12, 256), (N - 1, 7), (5,)]
    outs = hvd.grouped_reducescatter([contribution(R, s, np.float32) for s in shapes], op=hvd.Sum, name="rs.group")
    for shape, out in zip(shapes, outs):
        want = sum(contribution(r, shape, np.float32) for r in range(N))[rows(shape[0], R)]
        assert out.shape == want.shape and np.array_equal(out, want), (shape, out.shape, want.shape)

with check("a burst of large and small reducescatters, fused"):
    shapes = [(1 << 12, 256), (64,), (1 << 11, 512), (9, 3)] * 2
    handles = [hvd.reducescatter_async(contribution(R, s, np.float32), op=hvd.Sum, name=f"rs.burst.{i}")
               for i, s in enumerate(shapes)]
    for shape, handle in zip(shapes, handles):
        want = sum(contribution(r, shape, np.float32) for r in range(N))[rows(shape[0], R)]
        assert np.array_equal(hvd.synchronize(handle), want), shape

finish(R)
