"""Four ranks on a two-core machine, over shared memory: every kind of collective with exact values, a burst
of async allreduces, and a lockstep loop of small allreduces whose total time shows that waiting ranks give
their core to the rank doing the work (a transport that spun would take seconds per op here).
"""

import os
import time

import numpy as np
import rvod.numpy as hvd
from _check import check, finish
from rvod import _rvod

hvd.init()
R, N = hvd.rank(), hvd.size()

with check("four ranks over the expected transport"):
    assert N == 4, N
    assert _rvod.transport_kind() == os.environ.get("RVOD_TEST_TRANSPORT", "shm"), _rvod.transport_kind()

with check("allreduce, small to 16 MiB, every op"):
    for count in (1, 1000, 1 << 18, 1 << 22):
        x = np.full(count, R + 1, dtype=np.float32)
        assert np.array_equal(hvd.allreduce(x, op=hvd.Sum, name=f"ar{count}"), np.full(count, 10, np.float32))
        assert np.array_equal(hvd.allreduce(x, op=hvd.Max, name=f"mx{count}"), np.full(count, 4, np.float32))
        assert np.array_equal(hvd.allreduce(x, op=hvd.Average, name=f"av{count}"), np.full(count, 2.5, np.float32))

with check("allgather with a different first dimension per rank"):
    out = hvd.allgather(np.full((R + 1, 3), R, dtype=np.int64), name="ag")
    assert np.array_equal(out, np.concatenate([np.full((r + 1, 3), r, dtype=np.int64) for r in range(N)]))

with check("broadcast of 8 MiB from every root"):
    for root in range(N):
        x = np.full(1 << 21, R, dtype=np.float32)
        hvd.broadcast_(x, root_rank=root, name=f"bc{root}")
        assert np.array_equal(x, np.full(1 << 21, root, dtype=np.float32))

with check("alltoall and reducescatter"):
    out, received = hvd.alltoall(np.arange(N * 2, dtype=np.int32) + 100 * R, splits=[2] * N, name="a2a")
    assert list(received) == [2] * N
    assert np.array_equal(out, np.concatenate([np.arange(2 * R, 2 * R + 2, dtype=np.int32) + 100 * r
                                               for r in range(N)]))
    rs = hvd.reducescatter(np.ones((8, 2), dtype=np.float64) * (R + 1), op=hvd.Sum, name="rs")
    assert np.array_equal(rs, np.full((2, 2), 10.0))

with check("a burst of 200 async allreduces, fused"):
    xs = [np.full(100 + k, R * k, dtype=np.float64) for k in range(200)]
    handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"burst{k}") for k, x in enumerate(xs)]
    for k, (x, h) in enumerate(zip(xs, handles)):
        hvd.synchronize(h)
        assert np.array_equal(x, np.full(100 + k, 6 * k, dtype=np.float64)), k

with check("grouped allreduces of 1 and 6 MiB, mixed dtypes, in and out of place (staged or not by size)"):
    # With RVOD_FUSION_THRESHOLD=1 MiB the staging areas hold 4 MiB: the 6 MiB group packs into a private
    # buffer and goes over the channels instead; with the default they hold it too.
    for total in (1 << 20, 6 << 20):
        count = total // 4 // 3
        group = [np.full(count, R + 1, np.float32), np.arange(count, dtype=np.int32) * (R + 1),
                 np.full((count // 2, 2), R - 1.5, np.float64)]
        outs = hvd.grouped_allreduce(group, op=hvd.Sum, name=f"group{total}")
        hvd.grouped_allreduce_(group, op=hvd.Average, name=f"group{total}_")
        want = [np.full(count, 10, np.float32), np.arange(count, dtype=np.int32) * 10,
                np.full((count // 2, 2), 0.0, np.float64)]
        for got, averaged, expected in zip(outs, group, want):
            assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape)
            assert np.array_equal(got, expected), (total, got[:4], expected[:4])
            average = expected / 4 if expected.dtype != np.int32 else expected // 4
            assert np.array_equal(averaged, average.astype(expected.dtype)), (total, averaged[:4])

with check("300 lockstep small allreduces finish promptly with more ranks than cores"):
    tiny = np.ones(1, dtype=np.float32)
    start = time.perf_counter()
    for _ in range(300):
        assert hvd.allreduce(tiny, op=hvd.Sum, name="tiny")[0] == 4
    elapsed = time.perf_counter() - start
    print(f"rank {R}: 300 small allreduces in {elapsed:.3f} s ({elapsed / 300 * 1e6:.0f} us each)", flush=True)
    assert elapsed < 30, f"300 small allreduces took {elapsed:.1f} s"

hvd.shutdown()
finish(R)
