"""Small synchronous rvod.numpy ops in steady state (the fast lane once cached): values, dtypes, shapes, new
arrays or the input itself; ranks taking different paths for one op; a mismatch after caching; the GIL
released while a rank waits for a late peer. Any number of ranks >= 2. Used by test_small_ops.py."""

import threading
import time

import numpy as np
from _check import check, expect_error, finish

import rvod.numpy as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()


def values(r, shape, dtype, step):
    return ((np.arange(int(np.prod(shape))).reshape(shape) + r + step) % 5).astype(dtype)


def compare(wrong, what, x, y, want, before):
    """``y`` is a new array of ``x``'s dtype holding ``want``; ``x`` still holds ``before``."""
    if not (type(y) is np.ndarray and y.dtype == x.dtype and y.shape == want.shape and np.array_equal(y, want)):
        wrong.append(f"{what}: got {y!r}, want {want!r}")
    if np.shares_memory(x, y) or not np.array_equal(x, before):
        wrong.append(f"{what}: the input changed or is the result")


DTYPES = (np.float32, np.float16, np.int8, np.int64, np.bool_)
wrong = []
for step in range(30):
    for dtype in DTYPES:
        for shape in ((), (3,), (2, 3)):
            x = values(rank, shape, dtype, step)
            y = hvd.allreduce(x, op=hvd.Max, name=f"max.{np.dtype(dtype).name}.{len(shape)}")
            want = np.maximum.reduce([values(r, shape, dtype, step) for r in range(size)])
            compare(wrong, f"step {step} {np.dtype(dtype).name} {shape}", x, y, want, values(rank, shape, dtype, step))
with check("max of every rank's values, in a new array like the input"):
    assert not wrong, "\n".join(wrong[:5])

wrong = []
for step in range(30):
    for dtype in DTYPES:
        for shape, uneven in (((1,), False), ((3,), False), ((2, 3), False), ((0, 3), False), ((2, 3), True)):
            # With `uneven`, rank r has r + 1 rows (the headers differ: the ordinary round runs it).
            shapes = [(r + 1,) + shape[1:] if uneven else shape for r in range(size)]
            x = values(rank, shapes[rank], dtype, step)
            name = f"gather.{np.dtype(dtype).name}.{shape}.{uneven}"
            y = hvd.allgather(x, name=name)
            want = np.concatenate([values(r, shapes[r], dtype, step) for r in range(size)])
            compare(wrong, f"step {step} {name}", x, y, want, values(rank, shapes[rank], dtype, step))
with check("allgather: every rank's rows in rank order, in a new array of the input's dtype"):
    assert not wrong, "\n".join(wrong[:5])

results = []
for step in range(30):
    total = np.array([rank + step, 1.5], dtype=np.float64)
    same = hvd.allreduce_(total, op=hvd.Sum, name="sum_")
    scaled = hvd.allreduce(np.full(4, rank + 1, np.float32), op=hvd.Average, prescale_factor=2.0,
                           postscale_factor=0.5, name="scaled")
    b = np.full(3, rank * 10 + step, np.int32)
    got = hvd.broadcast(b, root_rank=size - 1, name="bcast")
    b_ = np.full(2, rank + step, np.float32)
    same_ = hvd.broadcast_(b_, root_rank=1, name="bcast_")
    hvd.barrier()
    unnamed = hvd.allreduce(np.array([1], np.int32), op=hvd.Sum)
    results.append((step, total, same, scaled, b, got, b_, same_, unnamed))
step, total, same, scaled, b, got, b_, same_, unnamed = results[-1]
with check("allreduce_ writes the sum into its input and returns it"):
    assert same is total and np.array_equal(total, [size * (size - 1) / 2 + size * step, 1.5 * size]), total
with check("average with pre- and postscale factors"):
    assert scaled.dtype == np.float32 and np.allclose(scaled, (size + 1) / 2), scaled
with check("broadcast returns the root's values and leaves the input"):
    assert np.array_equal(got, np.full(3, (size - 1) * 10 + step)), got
    assert np.array_equal(b, np.full(3, rank * 10 + step)), b
with check("broadcast_ overwrites the input with the root's values"):
    assert same_ is b_ and np.array_equal(b_, [1 + step] * 2), b_
with check("unnamed ops match in call order"):
    assert all(r[-1].tolist() == [size] for r in results)

# Ranks on different paths for one op: rank 1's array is a strided view (exported as a copy), the others'
# are contiguous; the in-place result still lands in rank 1's view.
base = np.arange(8, dtype=np.float32) + rank
view = base[::2] if rank == 1 else base[:4].copy()
for _ in range(3):
    hvd.allreduce_(view, op=hvd.Min, name="mixed_paths")
with check("contiguous and strided arrays meet in one op; the view gets the result"):
    mine = [(np.arange(8, dtype=np.float32) + r)[::2] if r == 1 else (np.arange(8, dtype=np.float32) + r)[:4]
            for r in range(size)]
    assert np.array_equal(view, np.minimum.reduce(mine)), view
    assert rank != 1 or np.array_equal(base[::2], view)

# A mismatch after the name is cached: every rank raises, and the job goes on.
for _ in range(3):
    hvd.allreduce(np.ones(2, np.float32), name="shape_changes")
with check("a shape mismatch in steady state raises on every rank, naming the shapes"):
    expect_error(hvd.RvodMismatchError, r"shape_changes[\s\S]*\[2\][\s\S]*\[3\]|shape_changes[\s\S]*\[3\][\s\S]*\[2\]",
                 hvd.allreduce, np.ones(2 + (rank == size - 1), np.float32), name="shape_changes")
with check("the job goes on after the mismatch"):
    assert hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="after_mismatch").tolist() == [size]

# A late peer: the waiting rank releases the GIL, so its other threads run meanwhile.
hvd.allreduce(np.ones(1, np.float32), name="late")
ticks = [0]
stop = threading.Event()


def tick():
    while not stop.is_set():
        ticks[0] += 1


ticker = threading.Thread(target=tick)
if rank == 0:
    ticker.start()
else:
    time.sleep(0.3)
before = ticks[0]
late = hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="late")
stop.set()
if rank == 0:
    ticker.join()
with check("another thread ran while rank 0 waited for the late ranks"):
    assert rank != 0 or ticks[0] - before > 1000, ticks[0] - before
with check("the late op's value"):
    assert late.tolist() == [size], late
hvd.shutdown()
finish(rank)
