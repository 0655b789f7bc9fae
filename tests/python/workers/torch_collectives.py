"""What rvod.torch does beyond the collective cases every shim runs (collective_cases.py: every op x dtype
x variant): the module surface, mixed-dtype and non-contiguous groups, Horovod's positional arguments,
compression, tensors that need grad, the gradients of the differentiable ops, the error cases, sparse
allreduce, objects, barrier and join, checked against exact expected values. Run by rvodrun with 2 or 3
ranks.

Each rank knows what every rank contributes (the data depend only on the rank, the dtype, the shape and a
seed). Values are small integers, exact in every dtype including bfloat16, and sums are multiples of the
job size, so Average results are exact too.
"""

import re
import time

import torch
from _check import check, expect_error, finish

import rvod.torch as hvd
from rvod import _rvod
from rvod.exceptions import RvodInternalError, RvodMismatchError

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()

PRODUCT_VALUES = {True: [1, -2, 2, -1, 1, 3, -1], False: [1, 2, 3, 1, 2]}


def short(dtype):
    return str(dtype).replace("torch.", "")


def contribution(dtype, shape, rank, seed=0, product=False):
    """What `rank` contributes: for Product small factors, otherwise base + N * ((rank + i) % N), whose sum
    over ranks is a multiple of N and whose min and max come from different ranks for different elements."""
    count = 1
    for d in shape:
        count *= d
    i = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        values = (i + seed + rank) % 3 == 0
    elif product:
        table = torch.tensor(PRODUCT_VALUES[dtype != torch.uint8])
        values = table[(i + seed + 2 * rank) % len(table)]
    else:
        base = (i * 5 + seed) % 11
        if dtype != torch.uint8:
            base = base - 5
        values = base + N * ((rank + i) % N)
    return values.to(dtype).reshape(shape)


def expected_reduce(dtype, shape, op, seed=0, pre=1.0, post=1.0, ranks=None):
    ranks = range(N) if ranks is None else ranks
    stack = torch.stack([contribution(dtype, shape, r, seed, op == hvd.Product) for r in ranks])
    if dtype == torch.bool:
        return stack.any(0) if op in (hvd.Sum, hvd.Max) else stack.all(0)
    values = stack.double() * pre
    reduced = {
        hvd.Sum: lambda v: v.sum(0),
        hvd.Average: lambda v: v.sum(0) / N,
        hvd.Min: lambda v: v.min(0).values,
        hvd.Max: lambda v: v.max(0).values,
        hvd.Product: lambda v: v.prod(0),
    }[op](values) * post
    assert torch.equal(reduced * 256, torch.round(reduced * 256)), "test data must stay exact"
    return reduced.to(dtype)


def assert_tensor(out, expected, label=""):
    assert isinstance(out, torch.Tensor), f"{label}: result is {type(out)}"
    assert out.dtype == expected.dtype, f"{label}: dtype {out.dtype} != {expected.dtype}"
    assert out.shape == expected.shape, f"{label}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert out.device.type == "cpu", f"{label}: device {out.device}"
    if not torch.equal(out, expected):
        bad = (out.reshape(-1) != expected.reshape(-1)).nonzero().reshape(-1)[:5]
        raise AssertionError(f"{label}: wrong elements at {bad.tolist()}: got {out.reshape(-1)[bad].tolist()}, "
                             f"expected {expected.reshape(-1)[bad].tolist()}")


def assert_close(out, expected, label="", tol=1e-6):
    assert out.dtype == expected.dtype and out.shape == expected.shape, (label, out.dtype, out.shape)
    assert torch.allclose(out, expected, rtol=tol, atol=tol), f"{label}: {out} != {expected}"




def my_rows(total):
    base, extra = divmod(total, N)
    start = R * base + min(R, extra)
    return slice(start, start + base + (1 if R < extra else 0))


# ----------------------------------------------------------------------------------------- module surface

HOROVOD_TORCH_NAMES = """Compression allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters
allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async grouped_allreduce_
grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async grouped_allgather grouped_allgather_async
broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown is_initialized
start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled
mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product HorovodInternalError DistributedOptimizer
SyncBatchNorm mpi_ops _check_has_gpu""".split()

with check("module surface: Horovod's torch names, topology, constants"):
    missing = [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)]
    assert not missing, f"missing: {missing}"
    assert hvd.HorovodInternalError is RvodInternalError and issubclass(RvodMismatchError, RuntimeError)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.is_initialized() and hvd.size() == N and 0 <= R < N and hvd.local_rank() == R
    assert hvd.mpi_ops.is_homogeneous() is True and hvd._check_has_gpu() is False
    assert hvd.nccl_built() == _rvod.gpu_libraries()["nccl_version"]
    assert hvd.Compression.bf16.compress(torch.ones(2))[0].dtype == torch.bfloat16

# ------------------------------------------------------------------------------------------------ allreduce

with check("grouped allreduce: mixed dtypes, non-contiguous and negative-view members, inputs that need grad"):
    # The engine packs a group into one tensor per dtype; members it cannot read as they are (transposed,
    # negative view) make the whole group take the careful export path, which copies and writes back.
    dtypes = [torch.float32, torch.int64, torch.float32, torch.float64, torch.int64]
    shapes = [(3,), (2, 2), (), (5, 1), (0,)]
    group = [contribution(d, s, R, 40 + k) for k, (d, s) in enumerate(zip(dtypes, shapes))]
    expected = [expected_reduce(d, s, hvd.Sum, 40 + k) for k, (d, s) in enumerate(zip(dtypes, shapes))]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum, name="mixed")
    for out, exp in zip(outs, expected):
        assert_tensor(out, exp, "mixed dtypes")
    copies = [g.clone() for g in group]
    hvd.grouped_allreduce_(copies, op=hvd.Sum, name="mixed")
    for out, exp in zip(copies, expected):
        assert_tensor(out, exp, "mixed dtypes in place")

    base = contribution(torch.float32, (3, 4), R, 50)
    transposed = base.clone().t()
    negative = torch.zeros(6)._neg_view()
    negative_values = contribution(torch.float32, (6,), R, 51)
    negative.copy_(negative_values)
    wants_grad = contribution(torch.float32, (4,), R, 52).requires_grad_()
    returned = hvd.grouped_allreduce_([transposed, negative, wants_grad], op=hvd.Sum, name="careful")
    assert returned[0] is transposed and returned[1] is negative
    assert_tensor(transposed, expected_reduce(torch.float32, (3, 4), hvd.Sum, 50).t(), "transposed member")
    assert_tensor(negative.resolve_neg(), expected_reduce(torch.float32, (6,), hvd.Sum, 51), "negative-view member")
    assert torch.equal(wants_grad.detach(), expected_reduce(torch.float32, (4,), hvd.Sum, 52)), wants_grad

with check("async ops on one tensor: tensors DLPack cannot carry as they are take the careful path"):
    # One-tensor async ops hand DLPack capsules straight to the engine; a transposed tensor, a negative
    # view and one that needs grad must still come out right, in place and not, and unnamed ops match.
    def transposed(seed):
        return contribution(torch.float32, (3, 4), R, seed).clone().t()

    def negative(seed):
        view = torch.zeros(5)._neg_view()
        view.copy_(contribution(torch.float32, (5,), R, seed))
        return view

    in_place = [transposed(60), negative(61), contribution(torch.float32, (4,), R, 62).requires_grad_(),
                contribution(torch.int32, (7,), R, 63)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum) for t in in_place]
    out_of_place = hvd.allreduce_async(negative(64), op=hvd.Sum, name="async.negative")
    gathered = hvd.allgather_async(negative(65))
    scattered = hvd.reducescatter_async(transposed(66), op=hvd.Sum)
    broadcast_view = torch.full((3,), float(R))._neg_view()
    broadcast = hvd.broadcast_async_(broadcast_view, root_rank=N - 1)
    results = [hvd.synchronize(h) for h in handles]
    assert all(result is t for result, t in zip(results, in_place)), "in-place results are their inputs"
    assert_tensor(in_place[0], expected_reduce(torch.float32, (3, 4), hvd.Sum, 60).t(), "transposed, in place")
    assert_tensor(in_place[1].resolve_neg(), expected_reduce(torch.float32, (5,), hvd.Sum, 61), "negative, in place")
    assert torch.equal(in_place[2].detach(), expected_reduce(torch.float32, (4,), hvd.Sum, 62)), in_place[2]
    assert_tensor(in_place[3], expected_reduce(torch.int32, (7,), hvd.Sum, 63), "plain, in place")
    assert_tensor(hvd.synchronize(out_of_place), expected_reduce(torch.float32, (5,), hvd.Sum, 64),
                  "negative view, out of place")
    assert_tensor(hvd.synchronize(gathered), torch.cat([contribution(torch.float32, (5,), r, 65) for r in range(N)]),
                  "negative view, allgather")
    rows = expected_reduce(torch.float32, (3, 4), hvd.Sum, 66).t().contiguous()
    shares = [4 // N + (1 if r < 4 % N else 0) for r in range(N)]
    assert_tensor(hvd.synchronize(scattered), rows[sum(shares[:R]):sum(shares[:R + 1])], "transposed, reducescatter")
    assert hvd.synchronize(broadcast) is broadcast_view
    assert_tensor(broadcast_view.resolve_neg(), torch.full((3,), -float(N - 1)), "negative view, broadcast")

with check("allreduce: default op is Average; average= is deprecated but works; 0-d tensors"):
    x = torch.full((4,), 2.0 * N * (R + 1))
    assert_tensor(hvd.allreduce(x), torch.full((4,), float((N + 1) * N)), "default")
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_tensor(hvd.allreduce(x, average=False), torch.full((4,), float(N * N * (N + 1))), "average=False")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
    assert_tensor(hvd.allreduce(torch.tensor(R + 1), op=hvd.Sum), torch.tensor(N * (N + 1) // 2), "0-d")

with check("allreduce: positional arguments in Horovod's order"):
    y = contribution(torch.float32, (5,), R, 5)
    hvd.allreduce_(y, None, "positional", hvd.Sum)
    assert_tensor(y, expected_reduce(torch.float32, (5,), hvd.Sum, 5), "allreduce_ positional")
    out = hvd.allreduce(contribution(torch.float32, (5,), R, 5), None, "positional2", hvd.Compression.none, hvd.Sum)
    assert_tensor(out, expected_reduce(torch.float32, (5,), hvd.Sum, 5), "allreduce positional")

with check("allreduce: non-contiguous input (transposed, strided, negative view); in-place writes back"):
    base = contribution(torch.float64, (6, 4), R, 6)
    assert_tensor(hvd.allreduce(base.t(), op=hvd.Sum), expected_reduce(torch.float64, (6, 4), hvd.Sum, 6).t()
                  .contiguous(), "transposed")
    parent = contribution(torch.int32, (10,), R, 7)
    untouched = parent[1::2].clone()
    view = parent[::2]
    assert hvd.allreduce_(view, op=hvd.Sum) is view
    assert_tensor(parent[::2].contiguous(), expected_reduce(torch.int32, (10,), hvd.Sum, 7)[::2].contiguous(), "view")
    assert torch.equal(parent[1::2], untouched), "elements outside the view changed"
    negative = torch._neg_view(contribution(torch.float32, (5,), R, 8))
    assert_tensor(hvd.allreduce(negative, op=hvd.Sum), -expected_reduce(torch.float32, (5,), hvd.Sum, 8), "neg view")

with check("allreduce: 1M+3 float32, zero copy in place"):
    count = (1 << 20) + 3
    i = torch.arange(count, dtype=torch.int64)
    x = ((i % 1000) + R).float()
    pointer = x.data_ptr()
    hvd.allreduce_(x, op=hvd.Sum, name="large")
    assert x.data_ptr() == pointer
    assert_tensor(x, (N * (i % 1000) + N * (N - 1) // 2).float(), "1M+3")

with check("allreduce: fp16 and bf16 compression keep the dtype, reduce at reduced precision"):
    x = contribution(torch.float32, (9,), R, 9) / 4
    expected = expected_reduce(torch.float32, (9,), hvd.Sum, 9) / 4
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        assert_tensor(hvd.allreduce(x, op=hvd.Sum, compression=compression), expected, compression.__name__)
        outs = hvd.grouped_allreduce([x, x.double()], op=hvd.Sum, compression=compression)
        assert_tensor(outs[0], expected, "grouped " + compression.__name__)
        assert_tensor(outs[1], expected.double(), "grouped " + compression.__name__)
    ints = contribution(torch.int32, (5,), R, 10)
    assert_tensor(hvd.allreduce(ints, op=hvd.Sum, compression=hvd.Compression.fp16),
                  expected_reduce(torch.int32, (5,), hvd.Sum, 10), "ints pass through fp16 compression")
    tiny = torch.full((3,), 1e-3 + R * 1e-4)
    out = hvd.allreduce(tiny, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32 and torch.allclose(out, tiny.new_full((3,), N * 1e-3 + 1e-4 * N * (N - 1) / 2),
                                                         rtol=2e-3)

with check("allreduce: a tensor that requires grad, in place (as a parameter)"):
    weight = torch.nn.Parameter(contribution(torch.float32, (3, 2), R, 11))
    hvd.allreduce_(weight, op=hvd.Sum)
    assert torch.equal(weight.detach(), expected_reduce(torch.float32, (3, 2), hvd.Sum, 11))
    hvd.broadcast_(weight.t(), root_rank=0)
    assert torch.equal(weight.detach(), expected_reduce(torch.float32, (3, 2), hvd.Sum, 11))

# ------------------------------------------------------------------------------------------------ allgather

with check("allgather non-contiguous"):
    parent = contribution(torch.float32, (4, 6), R, 14)
    exp = torch.cat([contribution(torch.float32, (4, 6), r, 14)[:, ::3] for r in range(N)])
    assert_tensor(hvd.allgather(parent[:, ::3]), exp, "strided")

# ------------------------------------------------------------------------------------------------ broadcast

with check("broadcast: in-place into a transposed view"):
    parent = contribution(torch.int64, (4, 4), R, 17)
    hvd.broadcast_(parent.t(), 1)
    assert_tensor(parent, contribution(torch.int64, (4, 4), 1, 17), "broadcast_ transposed")

# ------------------------------------------------------------------------------------------------- alltoall

SPLITS = [[1, 0, 2], [2, 3, 0], [0, 1, 1]] if N == 3 else [[0, 3], [2, 1]]


# -------------------------------------------------------------------------------------------- reducescatter

ROWS_RS = 2 * N + 1
with check("reducescatter: default op is Average; positional order (name, compression, op)"):
    x = contribution(torch.float32, (N * 2,), R, 23)
    exp = expected_reduce(torch.float32, (N * 2,), hvd.Average, 23)[my_rows(N * 2)]
    assert_tensor(hvd.reducescatter(x), exp, "default")
    exp = expected_reduce(torch.float32, (N * 2,), hvd.Sum, 23)[my_rows(N * 2)]
    assert_tensor(hvd.reducescatter(x, "rs.positional", hvd.Compression.none, hvd.Sum), exp, "positional")

# ------------------------------------------------------------------------------------------------ gradients


def grad_of(function, x, grad_output):
    x = x.clone().requires_grad_()
    out = function(x)
    out.backward(grad_output)
    return x.grad


for dtype in (torch.float32, torch.float64):
    label = f"gradients {short(dtype)}"
    g = contribution(dtype, (4, 3), R, 30)  # each rank's output gradient differs
    g_sum = expected_reduce(dtype, (4, 3), hvd.Sum, 30)
    x = contribution(dtype, (4, 3), R, 31)
    with check(label + ": allreduce"):
        assert_tensor(grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x, g), g_sum, "Sum")
        assert_tensor(grad_of(lambda t: hvd.allreduce(t), x, g), g_sum / N, "Average")
        assert_close(grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0), x, g),
                     g_sum * 2, "scaled")
        assert_close(grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), x, g),
                     g_sum, "fp16 compression")
    with check(label + ": grouped_allreduce"):
        a, b = x.clone().requires_grad_(), x[:2].clone().requires_grad_()
        outs = hvd.grouped_allreduce([a, b], op=hvd.Sum)
        torch.autograd.backward(outs, [g, g[:2]])
        assert_tensor(a.grad, g_sum, "grouped a")
        assert_tensor(b.grad, g_sum[:2], "grouped b")
    with check(label + ": allgather (gradient averaged, own rows kept)"):
        rows = [r + 1 for r in range(N)]
        offset = sum(rows[:R])
        mine = contribution(dtype, (rows[R], 2), R, 32)
        gathered_grad = contribution(dtype, (sum(rows), 2), R, 33)
        averaged = expected_reduce(dtype, (sum(rows), 2), hvd.Average, 33)
        grad = grad_of(lambda t: hvd.allgather(t), mine, gathered_grad)
        assert_tensor(grad, averaged[offset:offset + rows[R]], "allgather")
        a, b = mine.clone().requires_grad_(), x.clone().requires_grad_()
        outs = hvd.grouped_allgather([a, b])
        torch.autograd.backward(outs, [gathered_grad, contribution(dtype, (4 * N, 3), R, 34)])
        assert_tensor(a.grad, averaged[offset:offset + rows[R]], "grouped allgather a")
        assert_tensor(b.grad, expected_reduce(dtype, (4 * N, 3), hvd.Average, 34)[4 * R:4 * R + 4],
                      "grouped allgather b")
    with check(label + ": broadcast (averaged gradient on the root, zero elsewhere)"):
        for root in range(N):
            grad = grad_of(lambda t: hvd.broadcast(t, root), x, g)
            assert_tensor(grad, g_sum / N if R == root else torch.zeros_like(g), f"broadcast root {root}")
    with check(label + ": alltoall (gradient goes back along the received splits)"):
        mine = contribution(dtype, (sum(SPLITS[R]), 2), R, 35)
        received_rows = sum(SPLITS[s][R] for s in range(N))
        out_grad = contribution(dtype, (received_rows, 2), R, 36) + 100 * R

        def back(dest_rank):
            """Rows of dest_rank's output gradient, in dest_rank's receive order, that came from this rank."""
            rows_from = [SPLITS[s][dest_rank] for s in range(N)]
            start = sum(rows_from[:R])
            sent_there = contribution(dtype, (sum(rows_from), 2), dest_rank, 36) + 100 * dest_rank
            return sent_there[start:start + rows_from[R]]

        expected = torch.cat([back(d) for d in range(N)])
        t = mine.clone().requires_grad_()
        out, received = hvd.alltoall(t, splits=SPLITS[R])
        out.backward(out_grad)
        assert_tensor(t.grad, expected, "alltoall")
        assert not received.requires_grad
        t = contribution(dtype, (2 * N,), R, 37).requires_grad_()
        hvd.alltoall(t).backward(torch.arange(2 * N, dtype=dtype) + 10 * R)
        assert_tensor(t.grad, torch.cat([torch.arange(2 * R, 2 * R + 2, dtype=dtype) + 10 * d for d in range(N)]),
                      "alltoall even")
    with check(label + ": reducescatter (allgathered gradient, times size for Sum, scaled)"):
        rs_input = contribution(dtype, (ROWS_RS, 2), R, 38)
        sizes = [ROWS_RS // N + (1 if r < ROWS_RS % N else 0) for r in range(N)]
        grads_by_rank = [contribution(dtype, (sizes[r], 2), r, 39) for r in range(N)]
        gathered = torch.cat(grads_by_rank)
        assert_tensor(grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum), rs_input, grads_by_rank[R]), gathered * N,
                      "Sum")
        assert_tensor(grad_of(lambda t: hvd.reducescatter(t), rs_input, grads_by_rank[R]), gathered, "Average")
        assert_close(grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                             rs_input, grads_by_rank[R]), gathered * N, "scaled")
        a, b = rs_input.clone().requires_grad_(), contribution(dtype, (N * 2,), R, 40).requires_grad_()
        outs = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
        torch.autograd.backward(outs, [grads_by_rank[R], torch.full((2,), float(R + 1), dtype=dtype)])
        assert_tensor(a.grad, gathered * N, "grouped a")
        assert_tensor(b.grad, torch.cat([torch.full((2,), float(r + 1), dtype=dtype) for r in range(N)]) * N,
                      "grouped b")

# --------------------------------------------------------------------------------------------------- errors


def mismatch(label, call, values, subject):
    """Every rank raises RvodMismatchError (a RuntimeError) naming `subject` and the values."""
    with check(f"mismatch {label}"):
        message = expect_error(RvodMismatchError, re.escape(subject), call)
        for value in values:
            assert str(value) in message, f"{value!r} not in {message!r}"
    with check(f"allreduce after mismatch {label}"):
        assert_tensor(hvd.allreduce(torch.full((5,), R + 1), op=hvd.Sum, name=f"after.{label}"),
                      torch.full((5,), N * (N + 1) // 2), "after")


odd = R == 1
mismatch("shape", lambda: hvd.allreduce(torch.ones(3 if odd else 2), name="mm.shape"), ["[2]", "[3]"],
         "allreduce.mm.shape")
mismatch("dtype", lambda: hvd.allreduce(torch.ones(2, dtype=torch.float64 if odd else torch.float32),
                                        name="mm.dtype"), ["float32", "float64"], "data type")
mismatch("root rank", lambda: hvd.broadcast(torch.ones(2), root_rank=1 if odd else 0, name="mm.root"),
         ["sent 0", "sent 1"], "root")
mismatch("reduce op", lambda: hvd.allreduce(torch.ones(2), op=hvd.Max if odd else hvd.Sum, name="mm.op"),
         ["Sum", "Max"], "mm.op")
mismatch("in-place async dtype", lambda: hvd.synchronize(hvd.allreduce_async_(
    torch.ones(2, dtype=torch.int16 if odd else torch.uint8), name="mm.async")), ["uint8", "int16"], "mm.async")
mismatch("allgather trailing shape", lambda: hvd.allgather(torch.ones(2, 4 if odd else 3), name="mm.ag"),
         ["[3]", "[4]"], "allgather")

with check("mismatch errors are RuntimeErrors and ValueErrors, not HorovodInternalError (elastic must not retry)"):
    try:
        hvd.allreduce(torch.ones(4 if odd else 5), name="mm.runtime")
    except RuntimeError as error:
        assert isinstance(error, RvodMismatchError) and isinstance(error, ValueError)
        assert not isinstance(error, hvd.HorovodInternalError)
    else:
        raise AssertionError("no error")

with check("duplicate in-flight name raises ValueError; the first op completes"):
    x = torch.full((1 << 16,), float(R + 1))
    if R != 0:
        time.sleep(1.0)
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="dup")
    if R == 0:
        expect_error(ValueError, r"same name.*'allreduce\.dup'", hvd.allreduce_async, x, op=hvd.Sum, name="dup")
        expect_error(ValueError, r"same name", hvd.allreduce_, x.clone(), op=hvd.Sum, name="dup")
    assert_tensor(hvd.synchronize(handle), torch.full((1 << 16,), N * (N + 1) / 2), "dup")

x = torch.arange(N * 2, dtype=torch.float32)
# torch.uint32 exists from PyTorch 2.3; before, complex128 stands in as another dtype the engine lacks.
UNSUPPORTED = getattr(torch, "uint32", torch.complex128)
refused = [
    ("unsupported dtype complex64", ValueError, r"Tensor type .* is not supported",
     lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64))),
    (f"unsupported dtype {UNSUPPORTED}", ValueError, r"not supported", lambda: hvd.allgather(torch.ones(2).to(UNSUPPORTED))),
    ("meta device", ValueError, "device 'meta'", lambda: hvd.allreduce(torch.ones(2, device="meta"))),
    ("sparse tensor to allreduce", ValueError, "sparse", lambda: hvd.allreduce(torch.ones(2).to_sparse())),
    ("not a tensor", TypeError, "torch.Tensor", lambda: hvd.allreduce_([1.0, 2.0])),
    ("alltoall int64 splits", ValueError, "alltoall expects splits to contain 32-bit integer elements.",
     lambda: hvd.alltoall(x, splits=torch.tensor([2] * N))),
    ("alltoall uneven", ValueError, "splits not provided, but first dimension of tensor is not an even multiple",
     lambda: hvd.alltoall(torch.arange(2 * N + 1))),
    ("alltoall wrong number of splits", ValueError, "Number of entries in splits",
     lambda: hvd.alltoall(x, splits=[1] * (N + 1))),
    ("alltoall splits sum too large", ValueError, "Sum of splits entries is greater than the first dimension",
     lambda: hvd.alltoall(x, splits=[N * 2] * N)),
    ("reducescatter Max", ValueError, "(?i)Reducescatter currently only supports Average and Sum",
     lambda: hvd.reducescatter(x, op=hvd.Max)),
    ("allgather 0-d", ValueError, "dimension", lambda: hvd.allgather(torch.tensor(1.0))),
    ("broadcast root out of range", ValueError, "root", lambda: hvd.broadcast(x, N)),
    ("Adasum of integers", ValueError, "Adasum.*int64", lambda: hvd.allreduce(torch.arange(4), op=hvd.Adasum)),
    ("join with a device that is not an id", TypeError, "device id", lambda: hvd.join("cuda:0")),
    ("sparse_allreduce_async Max", ValueError, "Sum and Average",
     lambda: hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), "sp", hvd.Max)),
]
if torch.cuda.is_available():
    refused.append(("CUDA tensor", ValueError, "GPU support needs an rvod build with NCCL",
                    lambda: hvd.allreduce(torch.ones(2, device="cuda"))))
for label, error_type, pattern, call in refused:
    with check(f"refused: {label}"):
        expect_error(error_type, pattern, call)

# ---------------------------------------------------------------------------------- sparse, objects, barrier

with check("sparse_allreduce_async: Sum and Average of COO tensors with different nonzeros per rank"):
    dense = torch.zeros(6, 2)
    dense[R] = float(R + 1)
    dense[5] = 1.0
    expected_sum = torch.zeros(6, 2)
    for r in range(N):
        expected_sum[r] += r + 1
    expected_sum[5] = N
    wait = hvd.sparse_allreduce_async(dense.to_sparse(), "sparse.sum", hvd.Sum)
    result = wait()
    assert result.layout == torch.sparse_coo and result.shape == (6, 2)
    assert_tensor(result.to_dense(), expected_sum, "sparse Sum")
    assert_tensor(hvd.sparse_allreduce_async(dense.to_sparse(), None, hvd.Average)().to_dense(), expected_sum / N,
                  "sparse Average")

with check("broadcast_object and allgather_object"):
    for root in range(N):
        got = hvd.broadcast_object({"rank": R, "t": torch.tensor([R]), "betas": (0.9, R)}, root_rank=root)
        assert got["rank"] == root and got["betas"] == (0.9, root) and torch.equal(got["t"], torch.tensor([root]))
    assert hvd.allgather_object({"rank": R, "blob": b"x" * (R * 1000)}) == [
        {"rank": r, "blob": b"x" * (r * 1000)} for r in range(N)]

with check("barrier waits for the slowest rank"):
    if R == 1:
        time.sleep(0.3)
    entered = time.time()
    hvd.barrier()
    left = time.time()
    assert left >= max(hvd.allgather_object(entered, name="barrier.entered"))

with check("timeline calls raise Horovod's ValueError when RVOD_TIMELINE was not set (test_timeline.py covers the rest)"):
    for call in (lambda: hvd.start_timeline("/tmp/unused-timeline.json"), hvd.stop_timeline):
        try:
            call()
            raise AssertionError("no error")
        except ValueError as e:
            assert str(e) == "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.", e

# ----------------------------------------------------------------------------------------------------- join

with check("join: an early rank contributes zeros (Average still divides by the full size); same last rank"):
    joiner = N - 1
    active = [r for r in range(N) if r != joiner]
    if R == joiner:
        last = hvd.join()
    else:
        for step in range(3):
            x = contribution(torch.float32, (7, 3), R, 50 + step)
            assert_tensor(hvd.allreduce(x, op=hvd.Sum, name=f"join.{step}"),
                          expected_reduce(torch.float32, (7, 3), hvd.Sum, 50 + step, ranks=active), "join Sum")
        x = torch.full((4,), float(N * (R + 1)))
        avg = hvd.allreduce(x, name="join.avg")
        assert_tensor(avg, torch.full((4,), float(sum(N * (r + 1) for r in active)) / N), "join Average")
        y = torch.full((4,), float(R + 1), requires_grad=True)
        hvd.allreduce(y, op=hvd.Sum, name="join.grad").sum().backward()
        assert_tensor(y.grad, torch.full((4,), float(len(active))), "join gradient (joined rank adds zeros)")
        if R != 0:
            last = hvd.join()
        else:
            time.sleep(0.3)
            last = hvd.join()
    assert last == 0, f"join returned {last}, expected 0"

with check("collectives work after join"):
    assert_tensor(hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Sum, name="after.join"),
                  torch.full((3,), N, dtype=torch.int32), "after join")

hvd.shutdown()
finish(R)
