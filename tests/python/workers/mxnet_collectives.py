"""What rvod.mxnet does beyond the collective cases every shim runs (collective_cases.py: every op x dtype
x variant): the module surface, Horovod's positional argument orders, MXNet's asynchronous engine, mx.np
arrays, the error cases, Adasum, the object helpers, barrier, join, re-init and process sets, checked
against exact expected values. Run by rvodrun with 2 ranks (any size works).

Each rank knows what every rank contributes (the data depend only on the rank, the dtype, the shape and a
seed). Values are small integers, exact in every dtype including float16 and bfloat16, and sums are
multiples of the job size, so Average results are exact too.
"""

import warnings

import mxnet as mx
import numpy as np
from _check import check, expect_error, finish

import rvod.mxnet as hvd
from rvod import _rvod
from rvod.exceptions import RvodInternalError, RvodMismatchError

hvd.init()
R, N = hvd.rank(), hvd.size()

BFLOAT16 = np.dtype([("bfloat16", np.uint16)])
PRODUCT_VALUES = {True: [1, -2, 2, -1, 1, 3, -1], False: [1, 2, 3, 1, 2]}


def nd(values, dtype):
    """An NDArray of ``dtype`` holding the (exactly representable) ``values``."""
    values = np.asarray(values)
    if values.size == 0:  # MXNet 1.9 cannot run ops (casts included) on empty arrays
        return mx.nd.empty(values.shape, dtype=BFLOAT16 if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        return mx.nd.array(values.astype(np.float32), dtype=np.float32).astype(BFLOAT16)
    return mx.nd.array(values, dtype=dtype)


def values_of(array):
    """The values of an NDArray as NumPy (bfloat16 read through float32)."""
    if np.dtype(array.dtype) == BFLOAT16:
        return np.zeros(array.shape) if array.size == 0 else array.astype(np.float32).asnumpy()
    return array.asnumpy()


def contribution(dtype, shape, rank, seed=0, product=False):
    """What `rank` contributes, as NumPy float64: for Product small factors, otherwise base + N * ((rank + i)
    % N), whose sum over ranks is a multiple of N and whose min and max come from different ranks."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    if product:
        table = np.array(PRODUCT_VALUES[dtype != "uint8"])
        values = table[(i + seed + 2 * rank) % len(table)]
    else:
        base = (i * 5 + seed) % 11
        if dtype != "uint8":
            base = base - 5
        values = base + N * ((rank + i) % N)
    return values.astype(np.float64).reshape(shape)


def mine(dtype, shape, seed=0, product=False):
    return nd(contribution(dtype, shape, R, seed, product), dtype)


def expected_reduce(dtype, shape, op, seed=0, pre=1.0, post=1.0):
    stack = np.stack([contribution(dtype, shape, r, seed, op == hvd.Product) for r in range(N)]) * pre
    reduced = {
        hvd.Sum: lambda v: v.sum(0),
        hvd.Average: lambda v: v.sum(0) / N,
        hvd.Min: lambda v: v.min(0),
        hvd.Max: lambda v: v.max(0),
        hvd.Product: lambda v: v.prod(0),
    }[op](stack) * post
    assert np.array_equal(reduced * 256, np.round(reduced * 256)), "test data must stay exact"
    return reduced


def assert_nd(out, expected, dtype, label=""):
    """``out`` is an NDArray of ``dtype`` on the CPU equal to the float64 NumPy array ``expected``."""
    assert isinstance(out, mx.nd.NDArray), f"{label}: result is {type(out)}"
    want = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    assert np.dtype(out.dtype) == want, f"{label}: dtype {out.dtype} != {dtype}"
    assert out.shape == expected.shape, f"{label}: shape {out.shape} != {expected.shape}"
    assert out.context == mx.cpu(), f"{label}: context {out.context}"
    got = values_of(out).astype(np.float64)
    if not np.array_equal(got, expected):
        bad = np.flatnonzero(got.reshape(-1) != expected.reshape(-1))[:5]
        raise AssertionError(f"{label}: wrong elements at {bad.tolist()}: got {got.reshape(-1)[bad].tolist()}, "
                             f"expected {expected.reshape(-1)[bad].tolist()}")


def my_rows(total):
    base, extra = divmod(total, N)
    start = R * base + min(R, extra)
    return slice(start, start + base + (1 if R < extra else 0))


# ----------------------------------------------------------------------------------------- module surface

HOROVOD_MXNET_NAMES = """Compression allgather_object broadcast_object allgather allreduce allreduce_ grouped_allreduce
grouped_allreduce_ grouped_allgather alltoall broadcast broadcast_ reducescatter grouped_reducescatter init shutdown
is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank
mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built
rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum Adasum Min Max Product
DistributedOptimizer DistributedTrainer broadcast_parameters mpi_ops join barrier""".split()

with check("module surface: Horovod's mxnet names, topology, constants"):
    missing = [name for name in HOROVOD_MXNET_NAMES if not hasattr(hvd, name)]
    assert not missing, f"missing: {missing}"
    assert sorted(hvd.__all__) == sorted(set(hvd.__all__)) and all(hasattr(hvd, n) for n in hvd.__all__)
    assert not hasattr(hvd, "is_homogeneous") and hvd.mpi_ops.is_homogeneous() is True
    assert hvd.HorovodInternalError is RvodInternalError and issubclass(RvodMismatchError, ValueError)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.is_initialized() and hvd.size() == N and 0 <= R < N and hvd.local_rank() == R
    gpu = _rvod.gpu_libraries()  # CUDA and NCCL as found at run time (0 / False where they are not)
    assert hvd.nccl_built() == gpu["nccl_version"] and hvd.cuda_built() is (gpu["cuda_runtime_version"] > 0)

# ------------------------------------------------------------------------------------------------ allreduce

with check("allreduce: default op is Average; average= is deprecated but works; Horovod's positional order"):
    x = mx.nd.full((4,), 2.0 * N * (R + 1))
    assert_nd(hvd.allreduce(x), np.full((4,), float((N + 1) * N)), "float32", "default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_nd(hvd.allreduce(x, average=False), np.full((4,), float(N * N * (N + 1))), "float32", "average")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
    # allreduce(tensor, average, name, priority, prescale_factor, postscale_factor, process_set, op)
    y = mine("float32", (5,), 5)
    out = hvd.allreduce(y, None, "positional", 7, 2.0, 0.5, hvd.global_process_set, hvd.Sum)
    assert_nd(out, expected_reduce("float32", (5,), hvd.Sum, 5), "float32", "positional")
    assert hvd.allreduce_(y, None, "positional_", -3, 1.0, 1.0, hvd.global_process_set, hvd.Max) is y
    assert_nd(y, expected_reduce("float32", (5,), hvd.Max, 5), "float32", "positional in-place")

with check("allreduce: 1M+3 float32 in place; the input of a pending MXNet op; an array a pending op reads"):
    count = (1 << 20) + 3
    i = np.arange(count)
    x = mx.nd.array((i % 1000) + R, dtype=np.float32)
    hvd.allreduce_(x, op=hvd.Sum, name="large")
    assert_nd(x, (N * (i % 1000) + N * (N - 1) / 2).astype(np.float64), "float32", "1M+3")
    # MXNet runs ops asynchronously: the reduced value must be the one the queued ops produce ...
    a = mx.nd.ones((300, 300)) * (R + 1)
    produced = mx.nd.dot(a, a) / 300  # queued, probably not computed yet
    assert_nd(hvd.allreduce(produced, op=hvd.Sum), np.full((300, 300), float(sum((r + 1) ** 2 for r in range(N)))),
              "float32", "pending producer")
    # ... and an in-place result must not leak into a queued op that reads the array's old value.
    b = mx.nd.ones((300, 300)) * (R + 1)
    reader = mx.nd.dot(b, mx.nd.ones((300, 300))) / 300
    hvd.allreduce_(b, op=hvd.Sum)
    assert_nd(reader, np.full((300, 300), float(R + 1)), "float32", "pending reader")

with check("mx.np arrays: results are mx.np.ndarray; 0-d arrays; in-place"):
    x = mx.np.array([R + 1.0, 2.0])
    out = hvd.allreduce(x, op=hvd.Sum)
    assert isinstance(out, mx.np.ndarray) and out.tolist() == [N * (N + 1) / 2, 2.0 * N], out
    scalar = mx.np.array(float(R + 1))
    out = hvd.allreduce(scalar, op=hvd.Max)
    assert isinstance(out, mx.np.ndarray) and out.shape == () and float(out) == N
    assert hvd.broadcast_(scalar, 0) is scalar and float(scalar) == 1.0
    outs = hvd.grouped_allgather([mx.np.array([[R]]), mx.nd.array(np.zeros((R, 1))).as_np_ndarray()])
    assert all(isinstance(o, mx.np.ndarray) for o in outs) and outs[1].shape == (N * (N - 1) // 2, 1)

# ------------------------------------------------------------------------------------------------ broadcast

with check("broadcast: Horovod's positional order (root, name, priority)"):
    for root in range(N):
        out = hvd.broadcast(mine("float32", (5, 3), 15), root, f"bc.positional.{root}", 5)
        assert_nd(out, contribution("float32", (5, 3), root, 15), "float32", f"root {root}")

# -------------------------------------------------------------------------------------------- reducescatter

ROWS_RS = 2 * N + 1
with check("reducescatter: op second positionally; grouped: default Average, Horovod's positional order"):
    for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
        x = mine("float32", (ROWS_RS, 3), 20)
        expected = expected_reduce("float32", (ROWS_RS, 3), op, 20, 2.0)[my_rows(ROWS_RS)]
        assert_nd(hvd.reducescatter(x, op, prescale_factor=2.0), expected, "float32", op_name)
    shapes = [(ROWS_RS, 2), (N * 3,), (4097,)]
    tensors = [mine("int32", s, 22 + k) for k, s in enumerate(shapes)]
    outs = hvd.grouped_reducescatter(tensors)
    for k, (out, s) in enumerate(zip(outs, shapes)):
        assert_nd(out, expected_reduce("int32", s, hvd.Average, 22 + k)[my_rows(s[0])], "int32", "grouped")
    outs = hvd.grouped_reducescatter(tensors, hvd.Sum, "grs.positional", 1, hvd.global_process_set, 2.0)
    for k, (out, s) in enumerate(zip(outs, shapes)):
        assert_nd(out, expected_reduce("int32", s, hvd.Sum, 22 + k, 2.0)[my_rows(s[0])], "int32", "positional")

# -------------------------------------------------------------------------------------------------- errors

with check("mismatched shapes, dtypes, ops, roots and trailing dims raise RvodMismatchError on every rank"):
    expect_error(RvodMismatchError, r"Mismatched tensor shapes.*rank 0 sent \[2\]; rank 1 sent \[3\]",
                 hvd.allreduce, mx.nd.ones((R + 2,)), name="bad.shape")
    expect_error(RvodMismatchError, r"(?i)mismatched data types?.*(float32.*float64|float64.*float32)",
                 hvd.allreduce_, mx.nd.ones((3,), dtype="float32" if R == 0 else "float64"), name="bad.dtype")
    expect_error(RvodMismatchError, r"(?i)mismatched.*(Sum.*Max|Max.*Sum)",
                 hvd.allreduce, mx.nd.ones((3,)), name="bad.op", op=hvd.Sum if R == 0 else hvd.Max)
    expect_error(RvodMismatchError, r"(?i)mismatched.*root", hvd.broadcast_, mx.nd.ones((3,)), R, name="bad.root")
    expect_error(RvodMismatchError, r"(?i)mismatched", hvd.allgather, mx.nd.ones((2, R + 1)), name="bad.gather")
    expect_error(RvodMismatchError, r"(?i)mismatched", hvd.grouped_allreduce,
                 [mx.nd.ones((2,)), mx.nd.ones((R + 1,))], name="bad.group")
    # The job goes on: the same names work again once the ranks agree.
    assert_nd(hvd.allreduce(mx.nd.ones((2,)), name="bad.shape", op=hvd.Sum), np.full((2,), float(N)), "float32",
              "after the errors")

with check("Adasum: orthogonal vectors add, equal vectors stay, grouped too"):
    onehot = mx.nd.array(np.eye(N)[R] * (R + 1), dtype="float32")
    same = mx.nd.array([0.5, -1.0, 2.0], dtype="float64")
    assert hvd.allreduce(onehot, op=hvd.Adasum).asnumpy().tolist() == list(range(1, N + 1))
    grouped = hvd.grouped_allreduce([onehot, same], op=hvd.Adasum)
    assert grouped[0].asnumpy().tolist() == list(range(1, N + 1)) and grouped[1].dtype == np.float64
    assert grouped[1].asnumpy().tolist() == [0.5, -1.0, 2.0]

with check("bad input is refused before anything is sent, with the same message on every rank"):
    expect_error(TypeError, "expects an mxnet NDArray, got ndarray", hvd.allreduce, np.ones(3))
    expect_error(TypeError, "expects an mxnet NDArray, got list", hvd.broadcast_, [1, 2], 0)
    expect_error(ValueError, r"Tensor type bool is not supported.*astype\('uint8'\)", hvd.allreduce,
                 mx.nd.array([1, 0], dtype="bool"))
    expect_error(ValueError, r"row_sparse NDArrays are not supported; convert with .tostype\('default'\)",
                 hvd.allreduce, mx.nd.sparse.zeros("row_sparse", (3, 2)))
    expect_error(ValueError, "grouped_allreduce needs at least one tensor", hvd.grouped_allreduce, [])
    expect_error(ValueError, "grouped_reducescatter needs at least one tensor", hvd.grouped_reducescatter, [])
    expect_error(ValueError, "not an even multiple of the number of workers", hvd.alltoall, mx.nd.ones((2 * N + 1,)))
    expect_error(ValueError, "Adasum.*int32", hvd.allreduce, mx.nd.ones((2,), dtype="int32"), op=hvd.Adasum)
    expect_error(ValueError, "Unknown reduce op 9", hvd.allreduce, mx.nd.ones((2,)), op=9)
    expect_error(ValueError, "op parameter supersedes average", hvd.allreduce, mx.nd.ones((2,)), average=True,
                 op=hvd.Sum)
    expect_error(ValueError, "has not been registered", hvd.allreduce, mx.nd.ones((2,)),
                 process_set=hvd.ProcessSet([0]))
    expect_error(ValueError, "invalid params of type", hvd.broadcast_parameters, [mx.nd.ones(1)])
    assert_nd(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum), np.full((2,), float(N)), "float32", "after bad input")

# --------------------------------------------------------------------------- objects, barrier, join, shutdown

with check("broadcast_object and allgather_object, named and unnamed; broadcast_parameters of NDArrays"):
    assert hvd.broadcast_object({"from": R, "list": [R] * 3} if R == N - 1 else None, N - 1) == {
        "from": N - 1, "list": [N - 1] * 3}
    assert hvd.broadcast_object(("x", R), root_rank=0, name="obj") == ("x", 0)
    assert hvd.allgather_object({"rank": R, "pad": "x" * R * 100}) == [{"rank": r, "pad": "x" * r * 100}
                                                                       for r in range(N)]
    params = {"b": mx.nd.full((2, 2), R), "a": mx.nd.full((3,), R, dtype="int64")}
    hvd.broadcast_parameters(params, root_rank=N - 1, prefix="nd.")
    assert_nd(params["b"], np.full((2, 2), float(N - 1)), "float32", "param b")
    assert_nd(params["a"], np.full((3,), float(N - 1)), "int64", "param a")

with check("barrier; join returns the last rank to join; allreduce with joined ranks counts them as zeros"):
    hvd.barrier()
    if R == 0:
        out = hvd.allreduce(mx.nd.full((3,), 5.0), op=hvd.Sum, name="joined")
        assert_nd(out, np.full((3,), 5.0), "float32", "rank 0 alone, others joined")
    last = hvd.join()
    assert last == 0, last

with check("shutdown, then init again: ops work; ops after shutdown raise ValueError"):
    hvd.shutdown()
    assert not hvd.is_initialized()
    expect_error(ValueError, "has not been initialized", hvd.allreduce, mx.nd.ones((2,)))
    expect_error(ValueError, "has not been initialized", hvd.rank)
    hvd.init()
    assert_nd(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum), np.full((2,), float(N)), "float32", "after re-init")

with check("process sets: ops on a set without rank 0; the training helpers accept process_set"):
    hvd.shutdown()
    others = hvd.ProcessSet(range(1, N))
    hvd.init(process_sets=[others])
    if others.included():
        out = hvd.allreduce(mx.nd.full((2,), float(R)), op=hvd.Sum, process_set=others, name="others")
        assert_nd(out, np.full((2,), float(sum(range(1, N)))), "float32", "set without rank 0")
        assert_nd(hvd.broadcast(mx.nd.array([R]), N - 1, process_set=others), np.array([N - 1.0]), "float32", "root")
        optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=1.0), process_set=others)
        assert optimizer.rescale_grad == (1.0 / (N - 1) if N > 2 else 1.0)
        grad = mx.nd.full((3,), float(R))
        optimizer.update(0, mx.nd.zeros((3,)), grad, None)
        assert_nd(grad, np.full((3,), float(sum(range(1, N)))), "float32", "optimizer on a set")
    else:
        expect_error(ValueError, "not a member of the provided process set", hvd.allreduce, mx.nd.ones((2,)),
                     process_set=others)

hvd.shutdown()
finish(R)
