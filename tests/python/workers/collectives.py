"""Every rvod.numpy collective x every dtype x every variant, checked against exact expected values.

Run by rvodrun with 2 or 3 ranks. Each rank computes what every rank contributes (the data depend only on
the rank, the dtype, the shape and a seed), so it knows the exact result. Values are small integers or
halves, exactly representable in every dtype, and sums are multiples of the job size, so Average and
float16 results are exact too.

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
from _expected import alltoall_blocks
from rvod import _rvod

hvd.init()
R, N = hvd.rank(), hvd.size()
contribution = functools.partial(_expected.contribution, n=N)

with check("the job runs over the transport the test asked for"):
    wanted = os.environ.get("RVOD_TEST_TRANSPORT")
    assert wanted in (None, _rvod.transport_kind()), (wanted, _rvod.transport_kind())

INTS = [np.uint8, np.int8, np.int16, np.int32, np.int64]
FLOATS = [np.float16, np.float32, np.float64]
NUMERIC = INTS + FLOATS
ALL = NUMERIC + [np.bool_]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
SHAPES = [(0,), (1,), (7,), (4097,), (3, 5, 2)]


def name_of(dtype):
    return np.dtype(dtype).name




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


def scale_pairs(dtype):
    if dtype is np.bool_:
        return []
    if np.dtype(dtype).kind == "f":
        return [(0.5, 4.0), (4.0, 0.25)]
    return [(2.0, 1.0), (3.0, 1.0), (1.0, 2.0)]


def ops_for(dtype):
    return {k: v for k, v in OPS.items() if not (dtype is np.bool_ and v == hvd.Average)}


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
                  hvd.ccl_built, hvd.cuda_built, hvd.rocm_built):
        assert probe() is False, probe.__name__
    assert hvd.nccl_built() == 0

# ------------------------------------------------------------------------------------------------ allreduce

for dtype in ALL:
    for op_name, op in ops_for(dtype).items():
        for shape in SHAPES:
            label = f"allreduce {name_of(dtype)} {op_name} {shape}"
            x = contribution(dtype, shape, R, 1, op == hvd.Product)
            before = x.copy()
            expected = expected_reduce(dtype, shape, op, 1)
            with check(label + " out-of-place"):
                out = hvd.allreduce(x, op=op)
                assert_result(out, expected, label)
                assert not np.shares_memory(out, x)
                assert np.array_equal(x, before), "input changed"
            y = x.copy()
            with check(label + " in-place"):
                ret = hvd.allreduce_(y, op=op)
                assert ret is y
                assert_result(y, expected, label)

        shape = (7,)
        label = f"allreduce {name_of(dtype)} {op_name}"
        x = contribution(dtype, shape, R, 2, op == hvd.Product)
        expected = expected_reduce(dtype, shape, op, 2)
        with check(label + " async"):
            handle = hvd.allreduce_async(x, op=op)
            wait_done(hvd.poll, handle)
            assert hvd.poll(handle) is True
            assert_result(hvd.synchronize(handle), expected, label)
        y = x.copy()
        with check(label + " async in-place"):
            handle = hvd.allreduce_async_(y, op=op, name=f"inplace.{name_of(dtype)}.{op_name}")
            assert hvd.synchronize(handle) is y
            assert_result(y, expected, label)

        group_shapes = [(0,), (1,), (7,), (4097,)]
        group = [contribution(dtype, s, R, 3 + k, op == hvd.Product) for k, s in enumerate(group_shapes)]
        group_before = [g.copy() for g in group]
        group_expected = [expected_reduce(dtype, s, op, 3 + k) for k, s in enumerate(group_shapes)]
        with check(label + " grouped"):
            outs = hvd.grouped_allreduce(group, op=op)
            assert isinstance(outs, list) and len(outs) == len(group)
            for out, exp in zip(outs, group_expected):
                assert_result(out, exp, label)
            for g, b in zip(group, group_before):
                assert np.array_equal(g, b), "grouped input changed"
        with check(label + " grouped async"):
            handle = hvd.grouped_allreduce_async(group, op=op, name=f"grouped.{name_of(dtype)}.{op_name}")
            wait_done(hvd.poll, handle)
            for out, exp in zip(hvd.synchronize(handle), group_expected):
                assert_result(out, exp, label)
        copies = [g.copy() for g in group]
        with check(label + " grouped in-place"):
            rets = hvd.grouped_allreduce_(copies, op=op)
            assert all(a is b for a, b in zip(rets, copies))
            for out, exp in zip(copies, group_expected):
                assert_result(out, exp, label)
        copies = [g.copy() for g in group]
        with check(label + " grouped async in-place"):
            handle = hvd.grouped_allreduce_async_(copies, op=op)
            hvd.synchronize(handle)
            for out, exp in zip(copies, group_expected):
                assert_result(out, exp, label)

    for pre, post in scale_pairs(dtype):
        for op_name in ("Sum", "Average", "Min", "Max", "Product"):
            if op_name == "Product" and np.dtype(dtype).kind != "f":
                continue  # scaled integer products would overflow the small integer types
            op = OPS[op_name]
            label = f"allreduce {name_of(dtype)} {op_name} prescale={pre} postscale={post}"
            shape = (4, 3)
            x = contribution(dtype, shape, R, 4, op == hvd.Product)
            expected = expected_reduce(dtype, shape, op, 4, pre, post)
            with check(label):
                assert_result(hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post), expected, label)
            y = x.copy()
            with check(label + " in-place"):
                hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post)
                assert_result(y, expected, label)

with check("allreduce 0-d array"):
    for dtype in (np.float32, np.int64):
        x = np.array(R + 1, dtype=dtype)
        out = hvd.allreduce(x, op=hvd.Sum)
        assert_result(out, np.array(N * (N + 1) // 2, dtype=dtype), "0-d")
        out = hvd.allreduce(x, op=hvd.Max)
        assert_result(out, np.array(N, dtype=dtype), "0-d max")

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

ROWS = [3, 0, 2][:N] if N == 3 else [2, 0]
for dtype in ALL:
    for trailing in [(), (3,), (2, 2)]:
        label = f"allgather {name_of(dtype)} rows={ROWS} trailing={trailing}"
        parts = [contribution(dtype, (ROWS[r], *trailing), r, 10) for r in range(N)]
        expected = np.concatenate(parts, axis=0)
        x = parts[R].copy()
        with check(label):
            out = hvd.allgather(x)
            assert_result(out, expected, label)
            assert np.array_equal(x, parts[R]), "input changed"
        with check(label + " async"):
            handle = hvd.allgather_async(x, name=f"ag.{name_of(dtype)}.{len(trailing)}")
            wait_done(hvd.poll, handle)
            assert_result(hvd.synchronize(handle), expected, label)
    label = f"grouped_allgather {name_of(dtype)}"
    shapes = [lambda r: (ROWS[r], 2), lambda r: (r + 1,), lambda r: (4097 if r == 0 else 1,)]
    with check(label):
        outs = hvd.grouped_allgather([contribution(dtype, s(R), R, 11 + k) for k, s in enumerate(shapes)])
        assert len(outs) == len(shapes)
        for k, (out, s) in enumerate(zip(outs, shapes)):
            exp = np.concatenate([contribution(dtype, s(r), r, 11 + k) for r in range(N)])
            assert_result(out, exp, label)

with check("allgather non-contiguous"):
    parent = contribution(np.float32, (4, 6), R, 12)
    out = hvd.allgather(parent[:, ::3])
    exp = np.concatenate([contribution(np.float32, (4, 6), r, 12)[:, ::3] for r in range(N)])
    assert_result(out, exp, "allgather strided")

# ------------------------------------------------------------------------------------------------ broadcast

for dtype in ALL:
    for root in range(N):
        label = f"broadcast {name_of(dtype)} root={root}"
        shape = (5, 3)
        mine = contribution(dtype, shape, R, 13)
        expected = contribution(dtype, shape, root, 13)
        with check(label):
            out = hvd.broadcast(mine, root)
            assert_result(out, expected, label)
            assert out is not mine
            assert np.array_equal(mine, contribution(dtype, shape, R, 13)), "input changed"
        y = mine.copy()
        with check(label + " in-place"):
            assert hvd.broadcast_(y, root_rank=root) is y
            assert_result(y, expected, label)
        with check(label + " async"):
            handle = hvd.broadcast_async(mine, root, name=f"bc.{name_of(dtype)}.{root}")
            wait_done(hvd.poll, handle)
            assert_result(hvd.synchronize(handle), expected, label)
        y = mine.copy()
        with check(label + " async in-place"):
            assert hvd.synchronize(hvd.broadcast_async_(y, root)) is y
            assert_result(y, expected, label)

for shape in SHAPES + [()]:
    root = N - 1
    with check(f"broadcast float32 shape {shape}"):
        out = hvd.broadcast(contribution(np.float32, shape, R, 14), root)
        assert_result(out, contribution(np.float32, shape, root, 14), f"broadcast {shape}")

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

# SPLITS[s][d]: rows rank s sends to rank d (zeros included).
SPLITS = [[1, 0, 2], [2, 3, 0], [0, 1, 1]] if N == 3 else [[0, 3], [2, 1]]


def alltoall_input(dtype, rank, splits, trailing, seed):
    return contribution(dtype, (sum(splits), *trailing), rank, seed)


def alltoall_expected(dtype, splits_matrix, trailing, seed):
    return np.concatenate(alltoall_blocks(lambda s: alltoall_input(dtype, s, splits_matrix[s], trailing, seed), splits_matrix, R))


for dtype in ALL:
    for trailing in [(), (2,)]:
        label = f"alltoall {name_of(dtype)} trailing={trailing}"
        even = [[2] * N for _ in range(N)]
        x = alltoall_input(dtype, R, even[R], trailing, 17)
        expected = alltoall_expected(dtype, even, trailing, 17)
        with check(label + " without splits"):
            out = hvd.alltoall(x)
            assert_result(out, expected, label)
            assert np.array_equal(x, alltoall_input(dtype, R, even[R], trailing, 17)), "input changed"
        x = alltoall_input(dtype, R, SPLITS[R], trailing, 18)
        expected = alltoall_expected(dtype, SPLITS, trailing, 18)
        received = [SPLITS[s][R] for s in range(N)]
        with check(label + " with splits"):
            result = hvd.alltoall(x, splits=SPLITS[R])
            assert isinstance(result, tuple) and len(result) == 2, type(result)
            out, got = result
            assert_result(out, expected, label)
            assert [int(v) for v in np.asarray(got).reshape(-1)] == received, (got, received)
        with check(label + " with numpy splits, async"):
            handle = hvd.alltoall_async(x, splits=np.array(SPLITS[R], dtype=np.int32))
            wait_done(hvd.poll, handle)
            out, got = hvd.synchronize(handle)
            assert_result(out, expected, label)
            assert [int(v) for v in np.asarray(got).reshape(-1)] == received

with check("alltoall splits not covering the whole tensor, non-contiguous"):
    parent = contribution(np.float32, (8, 2), R, 19)
    x = parent[:, ::-1]
    out, got = hvd.alltoall(x, splits=[1] * N)
    exp = np.concatenate([contribution(np.float32, (8, 2), s, 19)[:, ::-1][R:R + 1] for s in range(N)])
    assert_result(out, exp, "alltoall partial")

# -------------------------------------------------------------------------------------------- reducescatter

ROWS_RS = 2 * N + 1  # not divisible by N: the first rank gets the extra row


def my_rows(total):
    base, extra = divmod(total, N)
    start = R * base + min(R, extra)
    return slice(start, start + base + (1 if R < extra else 0))


for dtype in NUMERIC:
    for op_name in ("Sum", "Average"):
        op = OPS[op_name]
        for pre, post in [(1.0, 1.0)] + scale_pairs(dtype):
            for shape in [(ROWS_RS,), (ROWS_RS, 3), (N, 2), (1, 2)]:
                label = f"reducescatter {name_of(dtype)} {op_name} {shape} pre={pre} post={post}"
                x = contribution(dtype, shape, R, 20)
                expected = expected_reduce(dtype, shape, op, 20, pre, post)[my_rows(shape[0])]
                with check(label):
                    out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
                    assert_result(out, expected, label)
                    assert np.array_equal(x, contribution(dtype, shape, R, 20)), "input changed"
    label = f"reducescatter {name_of(dtype)} async + grouped"
    with check(label):
        x = contribution(dtype, (ROWS_RS, 2), R, 21)
        handle = hvd.reducescatter_async(x, op=hvd.Sum, name=f"rs.{name_of(dtype)}")
        wait_done(hvd.poll, handle)
        assert_result(hvd.synchronize(handle),
                      expected_reduce(dtype, (ROWS_RS, 2), hvd.Sum, 21)[my_rows(ROWS_RS)], label)
        shapes = [(ROWS_RS, 2), (N * 3,), (4097,)]
        outs = hvd.grouped_reducescatter([contribution(dtype, s, R, 22 + k) for k, s in enumerate(shapes)])
        for k, (out, s) in enumerate(zip(outs, shapes)):
            assert_result(out, expected_reduce(dtype, s, hvd.Average, 22 + k)[my_rows(s[0])], label)

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
