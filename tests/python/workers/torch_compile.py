"""rvod.torch under torch.compile, run by rvodrun with 2 ranks: every synchronous op inside a compiled function
equals the eager op (float32 and int32, gradients too), torch._dynamo's explain finds no graph break around
allreduce, allgather and broadcast, an allgather traced for equal first dimensions raises on every rank when
they differ, the async forms still run (breaking the graph), and a compiled MLP trained on the digits data with
DistributedOptimizer (hooks firing during backward) and broadcast_parameters ends with the eager model's
parameters, sharded too.

Compiled with backend "aot_eager" (AOTAutograd traces forward and backward with rvod's fake kernels;
inductor's C++ code generation would take most of the test's time on a small machine).
"""

import copy

import torch
import torch._dynamo
from _check import check, expect_error, finish
from torch import nn

import rvod.torch as hvd
from rvod.exceptions import RvodMismatchError

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()
BACKEND = "aot_eager"


def compiled(fn, fullgraph=True):
    return torch.compile(fn, backend=BACKEND, fullgraph=fullgraph)


def same(got, want, label):
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want), f"{label}: {len(got)} results, eager gave {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{label}[{i}]: {g.dtype} {tuple(g.shape)} != {w.dtype} {tuple(w.shape)}"
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6), f"{label}[{i}]: {g} != eager {w}"


# ------------------------------------------------------------------------------------- every op, two dtypes


def every_op(x, y):
    """The synchronous ops on ``x`` (4 rows) and ``y``; in-place ones on copies."""
    dtype_float = x.is_floating_point()
    reduce_op = hvd.Average if dtype_float else hvd.Sum
    inplace = x.clone()
    hvd.allreduce_(inplace, op=hvd.Sum)
    group_inplace = [x.clone(), y.clone()]
    hvd.grouped_allreduce_(group_inplace, op=hvd.Max)
    broadcast_inplace = y.clone()
    hvd.broadcast_(broadcast_inplace, root_rank=1)
    return [
        hvd.allreduce(x, op=reduce_op),
        hvd.allreduce(x, op=hvd.Max, name="max"),
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0) if dtype_float else hvd.allreduce(x, op=hvd.Min),
        inplace,
        *hvd.grouped_allreduce([x, y], op=hvd.Sum),
        *group_inplace,
        hvd.allgather(x),
        hvd.allgather(y, name="gathered.y"),
        hvd.broadcast(x, root_rank=0),
        broadcast_inplace,
        hvd.alltoall(x),
        hvd.reducescatter(x, op=hvd.Sum),
        hvd.reducescatter(y, op=reduce_op),
    ]


for dtype in (torch.float32, torch.int32):
    x = (torch.arange(12, dtype=torch.float64).reshape(4, 3) * (R + 1) - 5).to(dtype)
    y = (torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * R).to(dtype)
    with check(f"every op compiled equals eager ({dtype})"):
        eager = every_op(x, y)
        for _ in range(2):  # the second call runs the cached graph, taking new names
            same(compiled(every_op)(x, y), eager, f"compiled {dtype}")
        assert torch.equal(x, (torch.arange(12, dtype=torch.float64).reshape(4, 3) * (R + 1) - 5).to(dtype))


def alltoall_with_splits(x):
    splits = [1, 3] if R == 0 else [2, 2]
    return hvd.alltoall(x, splits=splits)


with check("alltoall with splits: compiled (a graph break without captured dynamic shapes) equals eager"):
    x = torch.arange(8.0).reshape(4, 2) + 100 * R
    want = alltoall_with_splits(x)
    same(list(compiled(alltoall_with_splits, fullgraph=False)(x)), list(want), "alltoall splits")
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    try:
        same(list(compiled(alltoall_with_splits)(x)), list(want), "alltoall splits, captured")
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = False


# ----------------------------------------------------------------------------------------------- gradients


def differentiable(x):
    a = hvd.allreduce(x * 2, op=hvd.Sum)
    b = hvd.allgather(x.sin())
    c = hvd.broadcast(x.cos(), root_rank=1)
    d = hvd.alltoall(x + 1)
    e = hvd.reducescatter(x * x, op=hvd.Sum)
    f, g = hvd.grouped_allreduce([x.exp(), x * 3], op=hvd.Average)
    weights = torch.arange(1.0, 13.0).reshape(4, 3)
    return ((a * weights).sum() + (b * b).sum() + (c * weights).sum() + (d * weights).sum() + e.sum() * 3
            + (f * weights).sum() + g.sum())


with check("gradients through every differentiable op, compiled, equal eager's"):
    base = torch.arange(12.0).reshape(4, 3) / 10 + R
    x_eager = base.clone().requires_grad_()
    loss = differentiable(x_eager)
    loss.backward()
    x_compiled = base.clone().requires_grad_()
    loss_compiled = compiled(differentiable)(x_compiled)
    loss_compiled.backward()
    same(loss_compiled, loss, "loss")
    same(x_compiled.grad, x_eager.grad, "grad")


# -------------------------------------------------------------------------------------- graph breaks, errors


def three_ops(x):
    reduced = hvd.allreduce(x.relu(), op=hvd.Sum)
    gathered = hvd.allgather(reduced * 2)
    return hvd.broadcast(gathered + 1, root_rank=0).sum()


with check("explain: allreduce, allgather and broadcast break no graph"):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(three_ops)(torch.ones(3, 2))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1, explained.graph_count
    ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert {"rvod.allreduce.default", "rvod.allgather.default", "rvod.broadcast.default"} <= ops, ops

with check("explain: a compiled training step's forward and backward break no graph"):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def step(x):
        return hvd.allreduce(model(x), op=hvd.Average).square().sum()

    assert torch._dynamo.explain(step)(torch.ones(5, 3)).graph_break_count == 0

with check("allgather traced for equal first dimensions raises RvodMismatchError on every rank when they differ"):
    rows = 2 if R == 0 else 3
    message = expect_error(RvodMismatchError, r"allgather \(unnamed\): under torch.compile its output shape is "
                           r"fixed when tracing, for \d rows .*capture_dynamic_output_shape_ops",
                           compiled(lambda t: hvd.allgather(t) * 1), torch.ones(rows, 2))
    assert f"for {rows * N} rows" in message, message

with check("async forms inside a compiled function break the graph and still run"):
    def asynchronous(x):
        handle = hvd.allreduce_async(x + 1, op=hvd.Sum)
        return hvd.synchronize(handle) * 2

    same(compiled(asynchronous, fullgraph=False)(torch.ones(3) * R), asynchronous(torch.ones(3) * R), "async")


# --------------------------------------------------------------------------- training a compiled model (digits)


def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    return x, y


def train(model, optimizer, x, y, steps, batch=32):
    """``steps`` steps on this rank's half of each global batch; returns whether every step found reductions
    in flight after backward (the hooks fired during backward)."""
    hooks_fired = True
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        start = (step * batch * N) % (len(x) - batch * N)
        rows = slice(start + R * batch, start + (R + 1) * batch)
        optimizer.zero_grad()
        loss_fn(model(x[rows]), y[rows]).backward()
        hooks_fired &= bool(optimizer._pending) or not hasattr(optimizer, "_pending")
        optimizer.step()
    return hooks_fired


def max_difference(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


STEPS = 12
x_digits, y_digits = digits()
torch.manual_seed(R)  # different on each rank: broadcast_parameters makes them equal
initial = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

for sharded in (False, True):
    label = "sharded " if sharded else ""
    with check(f"a compiled MLP with a {label}DistributedOptimizer trains to the eager model's parameters"):
        torch._dynamo.reset()
        eager_model = copy.deepcopy(initial)
        compiled_model = torch.compile(copy.deepcopy(initial), backend=BACKEND)
        hvd.broadcast_parameters(eager_model.state_dict(), root_rank=0)
        hvd.broadcast_parameters(compiled_model.state_dict(), root_rank=0)
        assert max_difference(eager_model, compiled_model._orig_mod) == 0.0
        optimizers = [hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                               named_parameters=m.named_parameters(), sharded=sharded)
                      for m in (eager_model, compiled_model)]
        train(eager_model, optimizers[0], x_digits, y_digits, STEPS)
        hooks_fired = train(compiled_model, optimizers[1], x_digits, y_digits, STEPS)
        assert hooks_fired, "the compiled model's backward started no reduction before step()"
        for optimizer in optimizers:
            if sharded:
                optimizer.wait_for_parameters()  # reading p itself (see rvod.torch.parameter_gathers)
        difference = max_difference(eager_model, compiled_model._orig_mod)
        assert difference < 1e-5, f"compiled and eager parameters differ by {difference}"
        reference = hvd.broadcast(next(compiled_model.parameters()).detach(), root_rank=0, name=f"same.{label}")
        assert torch.equal(reference, next(compiled_model.parameters()).detach()), "ranks differ"

finish(R)
