"""What rvod.numpy does beyond the collective cases every shim runs (collective_cases.py: every op x dtype
x variant): topology, arrays that cross by other paths (non-contiguous, read-only, foreign byte order,
subclasses, lists), NaN, default ops, 1M+3 elements, barrier, objects, poll, join, the response cache and
fusion, checked against exact expected values.

Run by rvodrun with 2 or 3 ranks. Each rank computes what every rank contributes (the data depend only on
the rank, the dtype, the shape and a seed), so it knows the exact result.

Phases: everything with the default knobs; then, after shutdown and re-init, the fusion and response
cache checks with RVOD_FUSION_THRESHOLD=0 / RVOD_CACHE_CAPACITY=0 and with a small threshold and cache.
"""

import functools
import os
import time

import numpy as np
import rvod.numpy as hvd
from _check import check, finish, wait_done
import _expected
from rvod import _rvod

hvd.init()
R, N = hvd.rank(), hvd.size()
contribution = functools.partial(_expected.contribution, n=N)

with check("the job runs over the transport the test asked for"):
    wanted = os.environ.get("RVOD_TEST_TRANSPORT")
    assert wanted in (None, _rvod.transport_kind()), (wanted, _rvod.transport_kind())



def expected_reduce(dtype, shape, op, seed=0, pre=1.0, post=1.0, ranks=None):
    ranks = range(N) if ranks is None else ranks
    stack = np.stack([contribution(dtype, shape, r, seed, op == hvd.Product) for r in ranks])
    if dtype is np.bool_:
        if op in (hvd.Sum, hvd.Max):
            return np.logical_or.reduce(stack, axis=0)
        return np.logical_and.reduce(stack, axis=0)
    values = stack.astype(np.float64) * pre
    reduced = {
        hvd.Sum: lambda v: v.sum(0),
        hvd.Average: lambda v: v.sum(0) / N,
        hvd.Min: lambda v: v.min(0),
        hvd.Max: lambda v: v.max(0),
        hvd.Product: lambda v: v.prod(0),
    }[op](values) * post
    grain = 1 if np.dtype(dtype).kind in "iu" else 1024
    assert np.array_equal(reduced * grain, np.round(reduced * grain)), "test data must stay exact"
    return reduced.astype(dtype)


def assert_result(out, expected, label=""):
    assert isinstance(out, np.ndarray), f"{label}: result is {type(out)}"
    assert out.dtype == expected.dtype, f"{label}: dtype {out.dtype} != {expected.dtype}"
    assert out.shape == expected.shape, f"{label}: shape {out.shape} != {expected.shape}"
    if not np.array_equal(out, expected):
        bad = np.flatnonzero(out.reshape(-1) != expected.reshape(-1))
        raise AssertionError(f"{label}: {bad.size} wrong elements, first at {bad[:5]}: "
                             f"got {out.reshape(-1)[bad[:5]]}, expected {expected.reshape(-1)[bad[:5]]}")


# ----------------------------------------------------------------------------------------------- topology

with check("topology"):
    assert hvd.is_initialized()
    env = os.environ
    assert (R, N) == (int(env["RVOD_RANK"]), int(env["RVOD_SIZE"]))
    assert hvd.local_rank() == int(env["RVOD_LOCAL_RANK"]) == R
    assert hvd.local_size() == int(env["RVOD_LOCAL_SIZE"]) == N
    assert hvd.cross_rank() == int(env["RVOD_CROSS_RANK"]) == 0
    assert hvd.cross_size() == int(env["RVOD_CROSS_SIZE"]) == 1
    assert hvd.is_homogeneous() is True
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    for probe in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built, hvd.gloo_enabled, hvd.ddl_built,
                  hvd.ccl_built, hvd.rocm_built):
        assert probe() is False, probe.__name__
    gpu = _rvod.gpu_libraries()  # CUDA and NCCL as found at run time (0 / False where they are not)
    assert hvd.nccl_built() == gpu["nccl_version"] and hvd.cuda_built() is (gpu["cuda_runtime_version"] > 0)

# ------------------------------------------------------------------------------------------------ allreduce

with check("allreduce default op is Average, average= still works"):
    x = np.full(4, 2.0 * N * (R + 1), dtype=np.float32)
    assert_result(hvd.allreduce(x), np.full(4, float((N + 1) * N), dtype=np.float32), "default")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_result(hvd.allreduce(x, average=False), np.full(4, float(N * N * (N + 1)), dtype=np.float32), "avg")

with check("allreduce 1M+3 float32"):
    count = (1 << 20) + 3
    i = np.arange(count, dtype=np.int64)
    x = ((i % 1000) + R).astype(np.float32)
    out = hvd.allreduce(x, op=hvd.Sum, name="large")
    assert_result(out, (N * (i % 1000) + N * (N - 1) // 2).astype(np.float32), "1M+3")
    y = x.copy()
    hvd.allreduce_(y, op=hvd.Average, name="large.avg", prescale_factor=float(N))
    assert_result(y, (N * (i % 1000) + N * (N - 1) // 2).astype(np.float32), "1M+3 average in-place")

with check("allreduce non-contiguous input"):
    base = contribution(np.float64, (6, 4), R, 5)
    view = base.T  # Fortran-ordered view
    expected = expected_reduce(np.float64, (6, 4), hvd.Sum, 5).T
    out = hvd.allreduce(view, op=hvd.Sum)
    assert_result(out, np.ascontiguousarray(expected), "transposed")
    strided_parent = contribution(np.int32, (10,), R, 6)
    parent_before = strided_parent.copy()
    strided = strided_parent[::2]
    out = hvd.allreduce(strided, op=hvd.Sum)
    assert_result(out, expected_reduce(np.int32, (10,), hvd.Sum, 6)[::2].copy(), "strided")
    assert np.array_equal(strided_parent, parent_before), "input changed"

with check("allreduce_ non-contiguous input writes back into the view"):
    parent = contribution(np.float32, (10,), R, 7)
    odd_before = parent[1::2].copy()
    view = parent[::2]
    ret = hvd.allreduce_(view, op=hvd.Sum)
    assert ret is view
    assert_result(parent[::2].copy(), expected_reduce(np.float32, (10,), hvd.Sum, 7)[::2].copy(), "view")
    assert np.array_equal(parent[1::2], odd_before), "elements outside the view changed"
    matrix = contribution(np.int16, (3, 4), R, 8)
    hvd.allreduce_(matrix.T, op=hvd.Max)
    assert_result(matrix, expected_reduce(np.int16, (3, 4), hvd.Max, 8), "transposed in-place")

with check("allreduce read-only input"):
    x = contribution(np.float32, (5,), R, 9)
    x.flags.writeable = False
    assert_result(hvd.allreduce(x, op=hvd.Sum), expected_reduce(np.float32, (5,), hvd.Sum, 9), "read-only")

with check("allreduce of a non-native byte order array"):
    x = contribution(np.float32, (6,), R, 24).astype(">f4")
    out = hvd.allreduce(x, op=hvd.Sum)
    assert out.dtype.kind == "f" and out.dtype.itemsize == 4, out.dtype
    assert np.array_equal(out, expected_reduce(np.float32, (6,), hvd.Sum, 24))
    hvd.allreduce_(x, op=hvd.Sum)
    assert x.dtype == np.dtype(">f4") and np.array_equal(x, expected_reduce(np.float32, (6,), hvd.Sum, 24))

class _Tagged(np.ndarray):
    """An ndarray subclass: crosses by DLPack, not through the buffer protocol plain arrays use."""


with check("grouped allreduce_ of arrays that cross each way (plain, strided, foreign byte order, subclass)"):
    plain = contribution(np.float32, (3, 5), R, 25)
    parent = contribution(np.float64, (12,), R, 26)
    strided = parent[::3]
    foreign = contribution(np.int32, (4,), R, 27).astype(">i4")
    tagged = contribution(np.int64, (2, 2), R, 28).view(_Tagged)
    scalar = contribution(np.float16, (), R, 29)
    empty = np.zeros((0, 3), dtype=np.uint8)
    plain_address = plain.ctypes.data
    group = [plain, strided, foreign, tagged, scalar, empty]
    result = hvd.grouped_allreduce_(group, op=hvd.Sum)
    assert [r is g for r, g in zip(result, group)] == [True] * len(group)
    assert plain.ctypes.data == plain_address
    assert_result(plain, expected_reduce(np.float32, (3, 5), hvd.Sum, 25), "plain")
    assert_result(parent[::3].copy(), expected_reduce(np.float64, (12,), hvd.Sum, 26)[::3].copy(), "strided")
    assert foreign.dtype == np.dtype(">i4") and np.array_equal(foreign, expected_reduce(np.int32, (4,), hvd.Sum, 27))
    assert type(tagged) is _Tagged and np.array_equal(tagged, expected_reduce(np.int64, (2, 2), hvd.Sum, 28))
    assert_result(scalar, expected_reduce(np.float16, (), hvd.Sum, 29), "0-d")
    assert empty.shape == (0, 3)
    outs = hvd.grouped_allreduce([contribution(np.float32, (3, 5), R, 25).view(_Tagged), parent.copy()[::3]],
                                 op=hvd.Max)
    assert_result(outs[0], expected_reduce(np.float32, (3, 5), hvd.Max, 25), "subclass, out of place")

with check("NaN and infinities propagate like NumPy's add/minimum/maximum/multiply"):
    x = np.array([np.nan if R == 0 else 1.0, np.inf, -np.inf if R == N - 1 else 2.0, 1.0], dtype=np.float32)
    for op, ufunc in ((hvd.Sum, np.add), (hvd.Min, np.minimum), (hvd.Max, np.maximum), (hvd.Product, np.multiply)):
        stack = [np.array([np.nan if r == 0 else 1.0, np.inf, -np.inf if r == N - 1 else 2.0, 1.0], dtype=np.float32)
                 for r in range(N)]
        expected = ufunc.reduce(np.stack(stack), axis=0)
        out = hvd.allreduce(x, op=op)
        assert np.array_equal(out, expected, equal_nan=True), (op, out, expected)

with check("allreduce of Python lists and scalars"):
    assert_result(hvd.allreduce([1.0 * R, 2.0], op=hvd.Sum), np.array([N * (N - 1) / 2, 2.0 * N]), "list")
    assert_result(hvd.allreduce(np.float32(R), op=hvd.Max), np.array(N - 1, dtype=np.float32), "scalar")

# ------------------------------------------------------------------------------------------------ allgather

with check("allgather non-contiguous"):
    parent = contribution(np.float32, (4, 6), R, 12)
    out = hvd.allgather(parent[:, ::3])
    exp = np.concatenate([contribution(np.float32, (4, 6), r, 12)[:, ::3] for r in range(N)])
    assert_result(out, exp, "allgather strided")

# ------------------------------------------------------------------------------------------------ broadcast

with check("broadcast_ non-contiguous view"):
    parent = contribution(np.int64, (4, 4), R, 15)
    hvd.broadcast_(parent.T, 1)
    assert_result(parent, contribution(np.int64, (4, 4), 1, 15), "broadcast_ transposed")
    parent = contribution(np.float64, (12,), R, 16)
    odd = parent[1::2].copy()
    hvd.broadcast_(parent[::2], 0)
    assert_result(parent[::2].copy(), contribution(np.float64, (12,), 0, 16)[::2].copy(), "broadcast_ strided")
    assert np.array_equal(parent[1::2], odd)

# ------------------------------------------------------------------------------------------------- alltoall

with check("alltoall splits not covering the whole tensor, non-contiguous"):
    parent = contribution(np.float32, (8, 2), R, 19)
    x = parent[:, ::-1]
    out, got = hvd.alltoall(x, splits=[1] * N)
    exp = np.concatenate([contribution(np.float32, (8, 2), s, 19)[:, ::-1][R:R + 1] for s in range(N)])
    assert_result(out, exp, "alltoall partial")

# -------------------------------------------------------------------------------------------- reducescatter

def my_rows(total):
    base, extra = divmod(total, N)
    start = R * base + min(R, extra)
    return slice(start, start + base + (1 if R < extra else 0))


with check("reducescatter default op is Average"):
    x = contribution(np.float32, (N * 2,), R, 23)
    assert_result(hvd.reducescatter(x), expected_reduce(np.float32, (N * 2,), hvd.Average, 23)[my_rows(N * 2)], "")

with check("1M+3 elements through allgather, broadcast, alltoall and reducescatter"):
    count = (1 << 20) + 3
    i = np.arange(count + R, dtype=np.int64)
    out = hvd.allgather((i % 1000 + R).astype(np.float32), name="large.ag")
    assert_result(out, np.concatenate([(np.arange(count + r) % 1000 + r).astype(np.float32) for r in range(N)]), "ag")
    out = hvd.broadcast((np.arange(count) % 777 * (R + 1)).astype(np.float32), N - 1, name="large.bc")
    assert_result(out, (np.arange(count) % 777 * N).astype(np.float32), "bc")
    rows = count // N
    x = (np.arange(rows * N) % 1000 + 1000 * R).astype(np.float32)
    out = hvd.alltoall(x, name="large.a2a")
    sent = [(np.arange(rows * N) % 1000 + 1000 * s).astype(np.float32) for s in range(N)]
    assert_result(out, np.concatenate([block[R * rows:(R + 1) * rows] for block in sent]), "a2a")
    x = (np.arange(count) % 1000 + R).astype(np.float32)
    out = hvd.reducescatter(x, op=hvd.Sum, name="large.rs")
    assert_result(out, (N * (np.arange(count) % 1000) + N * (N - 1) // 2).astype(np.float32)[my_rows(count)], "rs")

# ------------------------------------------------------------------------------------------ barrier, objects

with check("barrier waits for the slowest rank"):
    if R == 1:
        time.sleep(0.3)
    entered = time.time()
    hvd.barrier()
    left = time.time()
    last_entry = max(hvd.allgather_object(entered, name="barrier.entered"))
    assert left >= last_entry, f"left the barrier {last_entry - left:.3f} s before the last rank entered it"
    hvd.barrier()

with check("broadcast_object from every root"):
    for root in range(N):
        obj = {"rank": R, "payload": list(range(R * 10)), "text": "é" * R}
        got = hvd.broadcast_object(obj, root_rank=root)
        assert got == {"rank": root, "payload": list(range(root * 10)), "text": "é" * root}, got
    assert hvd.broadcast_object(None if R else ("tuple", 1), name="named") == ("tuple", 1)

with check("allgather_object"):
    got = hvd.allgather_object({"rank": R, "blob": b"x" * (R * 1000)})
    assert got == [{"rank": r, "blob": b"x" * (r * 1000)} for r in range(N)], got
    assert hvd.allgather_object(R * [R]) == [r * [r] for r in range(N)]

# -------------------------------------------------------------------------------------------------- poll

with check("poll is False while a peer delays a 64 MiB allreduce, True after"):
    big = np.full(16 << 20, float(R + 1), dtype=np.float32)
    if R == 1:
        time.sleep(1.0)
    handle = hvd.allreduce_async(big, op=hvd.Sum, name="big")
    submitted = time.time()
    assert hvd.poll(handle) is False, "poll() was True right after submitting 64 MiB"
    if R == 0:
        time.sleep(0.3)
        polled, waiting = time.time(), hvd.poll(handle)
    wait_done(hvd.poll, handle, timeout=60)
    assert hvd.poll(handle) is True
    out = hvd.synchronize(handle)
    assert out.shape == big.shape and out.dtype == np.float32
    assert np.all(out == N * (N + 1) / 2), np.unique(out)[:5]
    peer_submitted = hvd.broadcast_object(submitted, root_rank=1, name="big.submitted")
    if R == 0 and polled < peer_submitted:  # (under heavy load rank 0 may have polled too late to tell)
        assert waiting is False, "poll() was True before rank 1 submitted"

# ----------------------------------------------------------------------------------------------------- join

with check("join: an early rank contributes zeros; join returns the same last rank everywhere"):
    joiner = N - 1
    if R == joiner:
        last = hvd.join()
    else:
        active = [r for r in range(N) if r != joiner]
        for step in range(5):
            x = contribution(np.float32, (7, 3), R, 30 + step)
            out = hvd.allreduce(x, op=hvd.Sum, name=f"join.{step}")
            assert_result(out, expected_reduce(np.float32, (7, 3), hvd.Sum, 30 + step, ranks=active), "join")
        xi = contribution(np.int32, (4097,), R, 40)
        out = hvd.allreduce(xi, op=hvd.Sum, name="join.int")
        assert_result(out, expected_reduce(np.int32, (4097,), hvd.Sum, 40, ranks=active), "join int32")
        # A grouped allreduce, and a burst that fuses, with the joined rank's zeros in the packed or fused
        # buffer (over shared memory: in its staging area).
        shapes = [(300, 7), (5,), (1000,)]
        group = [contribution(np.float32, shape, R, 42 + k) for k, shape in enumerate(shapes)]
        for k, (out, shape) in enumerate(zip(hvd.grouped_allreduce(group, op=hvd.Sum, name="join.group"), shapes)):
            assert_result(out, expected_reduce(np.float32, shape, hvd.Sum, 42 + k, ranks=active), "join group")
        handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"join.burst{k}") for k, x in enumerate(group)]
        for k, (handle, x, shape) in enumerate(zip(handles, group, shapes)):
            hvd.synchronize(handle)
            assert_result(x, expected_reduce(np.float32, shape, hvd.Sum, 42 + k, ranks=active), "join burst")
        if R != 0:
            last = hvd.join()
        else:
            if N > 2:
                # Only rank 0 is left: its allreduce completes with every other rank contributing zeros.
                x = contribution(np.float64, (5,), 0, 41)
                assert_result(hvd.allreduce(x, op=hvd.Sum, name="join.alone"), x, "join alone")
            time.sleep(0.3)
            last = hvd.join()
    assert last == 0, f"join returned {last}, expected 0 (the last rank to join)"

with check("collectives work after join"):
    out = hvd.allreduce(np.ones(3, dtype=np.int32), op=hvd.Sum, name="after.join")
    assert_result(out, np.full(3, N, dtype=np.int32), "after join")

with check("response cache: one name whose shape, dtype, op, scale, root, rows and splits change"):
    for step in range(4):
        out = hvd.allreduce(np.full(step + 3, R + 1.0), op=hvd.Sum, name="cache.shape")
        assert_result(out, np.full(step + 3, N * (N + 1) / 2), f"shape step {step}")
    for dtype in (np.float32, np.float64, np.int32, np.float32):
        out = hvd.allreduce(np.full(3, R + 1, dtype=dtype), op=hvd.Sum, name="cache.dtype")
        assert_result(out, np.full(3, N * (N + 1) // 2, dtype=dtype), f"dtype {dtype}")
    for op, value in ((hvd.Sum, N * (N + 1) / 2), (hvd.Max, N), (hvd.Sum, N * (N + 1) / 2), (hvd.Min, 1)):
        assert_result(hvd.allreduce(np.full(3, R + 1.0), op=op, name="cache.op"), np.full(3, float(value)), "op")
    for pre in (1.0, 2.0, 1.0):
        out = hvd.allreduce(np.full(3, R + 1.0), op=hvd.Sum, prescale_factor=pre, name="cache.scale")
        assert_result(out, np.full(3, pre * N * (N + 1) / 2), f"prescale {pre}")
    for step in range(2 * N):
        out = hvd.broadcast(np.full(2, float(R)), step % N, name="cache.root")
        assert_result(out, np.full(2, float(step % N)), f"root {step % N}")
    for step in range(3):
        out = hvd.allgather(np.full((R + step, 2), R), name="cache.rows")
        assert_result(out, np.concatenate([np.full((r + step, 2), r) for r in range(N)]), f"rows step {step}")
    for step in range(3):
        matrix = [[(s + d + step) % 3 for d in range(N)] for s in range(N)]
        out, got = hvd.alltoall(np.full((sum(matrix[R]), 1), R), splits=matrix[R], name="cache.splits")
        assert [int(v) for v in got] == [matrix[s][R] for s in range(N)], (step, got)
        assert_result(out, np.concatenate([np.full((matrix[s][R], 1), s) for s in range(N)]), f"splits {step}")

# ------------------------------------------------------------------- fusion and response cache, re-init


def fusion_round(phase, steps=3):
    """Many async allreduces in flight at once (mixed dtypes, ops, scales, sizes), synchronized in
    reverse order, repeated with the same names so the response cache serves later steps."""
    specs = []
    for k in range(40):
        dtype = [np.float32, np.float64, np.int32, np.float16, np.int64][k % 5]
        op = [hvd.Sum, hvd.Average, hvd.Max, hvd.Sum][k % 4]
        pre, post = (0.5, 2.0) if k % 7 == 0 and np.dtype(dtype).kind == "f" else (1.0, 1.0)
        shape = [(1,), (7,), (0,), (33, 3), (4097,), (2, 2)][k % 6]
        specs.append((k, dtype, op, pre, post, shape))
    for step in range(steps):
        handles = []
        for k, dtype, op, pre, post, shape in specs:
            x = contribution(dtype, shape, R, 50 + k + step)
            handles.append(hvd.allreduce_async(x, op=op, prescale_factor=pre, postscale_factor=post,
                                               name=f"fuse.{k}"))
        unnamed = [hvd.allreduce_async(np.full(3, R + k, dtype=np.float32), op=hvd.Sum) for k in range(10)]
        for k, handle in reversed(list(zip(range(10), unnamed))):
            assert_result(hvd.synchronize(handle), np.full(3, N * k + N * (N - 1) / 2, dtype=np.float32),
                          f"{phase} unnamed {k}")
        for (k, dtype, op, pre, post, shape), handle in reversed(list(zip(specs, handles))):
            assert_result(hvd.synchronize(handle), expected_reduce(dtype, shape, op, 50 + k + step, pre, post),
                          f"{phase} fuse.{k} step {step}")


with check("fusion with the default threshold"):
    fusion_round("default")

PHASES = [("threshold 0, no cache", {"RVOD_FUSION_THRESHOLD": "0", "RVOD_CACHE_CAPACITY": "0"}),
          ("threshold 4 KiB, cache of 2", {"HOROVOD_FUSION_THRESHOLD": "4096", "HOROVOD_CACHE_CAPACITY": "2",
                                            "RVOD_FUSION_THRESHOLD": "", "RVOD_CACHE_CAPACITY": ""})]
for phase, settings in PHASES:
    hvd.shutdown()
    with check(f"{phase}: not initialized after shutdown"):
        assert hvd.is_initialized() is False
    os.environ.update(settings)
    hvd.init()
    with check(f"{phase}: topology after re-init"):
        assert (hvd.rank(), hvd.size()) == (R, N)
    with check(f"fusion, {phase}"):
        fusion_round(phase)
    with check(f"grouped allreduce, {phase}"):
        outs = hvd.grouped_allreduce([contribution(np.float32, (s,), R, 60) for s in (1, 4097, 7)], op=hvd.Sum)
        for out, s in zip(outs, (1, 4097, 7)):
            assert_result(out, expected_reduce(np.float32, (s,), hvd.Sum, 60), phase)

hvd.shutdown()
finish(R)
