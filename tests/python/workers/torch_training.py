"""rvod.torch training features, run by rvodrun with 2 or 3 ranks: DistributedOptimizer (equivalence with
one process on the full batch, overlap with backward, groups, gradient accumulation, compression, GradScaler,
predivide, Sum, sparse gradients, unused parameters, synchronize / skip_synchronize, zero_grad, argument
errors), broadcast_parameters, broadcast_optimizer_state for many optimizers, SyncBatchNorm against
nn.BatchNorm on the concatenated batch, and ops, DistributedOptimizer and SyncBatchNorm on a process set
without rank 0.

The single-process reference runs inside every rank on the full batch, with no collective involved.
"""

import copy
import re
import warnings

import torch
import torch.nn.functional as F
from _check import check, finish
from torch import nn

import rvod.torch as hvd

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()
BATCH = 24  # every rank takes BATCH // N consecutive rows, an even number for N = 2, 3 and 4 (two micro-batches)
SHARD = slice(R * BATCH // N, (R + 1) * BATCH // N)


def expect_error(error_type, pattern, call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except error_type as error:
        assert re.search(pattern, str(error)), f"{type(error).__name__} message {str(error)!r} !~ {pattern!r}"
        return str(error)
    except Exception as error:
        raise AssertionError(f"expected {error_type.__name__}, got {type(error).__name__}: {error}") from error
    raise AssertionError(f"expected {error_type.__name__} matching {pattern!r}, nothing was raised")


def same_on_every_rank(tensors, label):
    """Every tensor is bit-identical to rank 0's."""
    for name, tensor in tensors:
        reference = hvd.broadcast(tensor.detach(), root_rank=0, name=f"same.{label}.{name}")
        assert torch.equal(reference, tensor.detach()), f"{label}: {name} differs from rank 0's"


def max_difference(model_a, model_b):
    state_b = model_b.state_dict()
    return max(float((value.double() - state_b[key].double()).abs().max()) if value.numel() else 0.0
               for key, value in model_a.state_dict().items())


class Net(nn.Module):
    """Convolution, batch norm (synchronized, plain, or none), and a linear classifier."""

    def __init__(self, sync_bn, batch_norm=True):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.Identity() if not batch_norm else hvd.SyncBatchNorm(4) if sync_bn else nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def data(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, BATCH, 1, 6, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (steps, BATCH), generator=generator)
    return x, y


def train_pair(make_optimizer, wrap, steps=4, micro_batches=1, loss_scale=1.0, tolerance=1e-10, label=""):
    """Trains the reference on the full batch and the distributed copy on this rank's shard; after every
    step the two agree within ``tolerance`` and the distributed parameters are identical on every rank.
    With micro-batches there is no batch norm (its statistics would cover a micro-batch only)."""
    torch.manual_seed(0)
    reference = Net(sync_bn=False, batch_norm=micro_batches == 1).double()
    model = Net(sync_bn=True, batch_norm=micro_batches == 1).double()
    model.load_state_dict(reference.state_dict())
    ref_opt = make_optimizer(reference)
    opt = wrap(make_optimizer(model), model)
    x, y = data(steps)
    for step in range(steps):
        ref_opt.zero_grad()
        F.cross_entropy(reference(x[step]), y[step]).backward()
        ref_opt.step()

        opt.zero_grad()
        shard_x, shard_y = x[step][SHARD], y[step][SHARD]
        for mx, my in zip(shard_x.chunk(micro_batches), shard_y.chunk(micro_batches)):
            (F.cross_entropy(model(mx), my) * loss_scale / micro_batches).backward()
        opt.step()
        difference = max_difference(model, reference)
        assert difference <= tolerance, f"{label} step {step}: differs from the full-batch reference by {difference}"
        same_on_every_rank(model.state_dict().items(), f"{label}.{step}")
    return model, opt


# ----------------------------------------------------------------------------- DistributedOptimizer: results

OPTIMIZERS = {  # name -> (factory, tolerance: Adam divides by the root of tiny second moments)
    "SGD": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3), 1e-10),
    "Adam": (lambda m: torch.optim.Adam(m.parameters(), lr=0.01), 1e-8),
}


def named(model):
    return model.named_parameters()


CONFIGS = {
    "default": (lambda o, m: hvd.DistributedOptimizer(o, named_parameters=named(m)), {}),
    "unnamed parameters": (lambda o, m: hvd.DistributedOptimizer(o), {}),
    "groups=2": (lambda o, m: hvd.DistributedOptimizer(o, named_parameters=named(m), groups=2), {}),
    "explicit groups": (lambda o, m: hvd.DistributedOptimizer(
        o, named_parameters=named(m), groups=[[m.conv.weight, m.conv.bias], [m.fc.weight, m.fc.bias]]), {}),
    "num_groups=3 (deprecated)": (lambda o, m: hvd.DistributedOptimizer(o, named_parameters=named(m), num_groups=3),
                                  {}),
    "backward_passes_per_step=2": (lambda o, m: hvd.DistributedOptimizer(
        o, named_parameters=named(m), backward_passes_per_step=2), {"micro_batches": 2}),
    "gradient_predivide_factor=2": (lambda o, m: hvd.DistributedOptimizer(
        o, named_parameters=named(m), gradient_predivide_factor=2.0), {}),
    "op=Sum on loss / size": (lambda o, m: hvd.DistributedOptimizer(o, named_parameters=named(m), op=hvd.Sum),
                              {"loss_scale": 1.0 / N}),
    "fp16 compression": (lambda o, m: hvd.DistributedOptimizer(
        o, named_parameters=named(m), compression=hvd.Compression.fp16), {"tolerance": 2e-3, "sgd_only": True}),
    "bf16 compression": (lambda o, m: hvd.DistributedOptimizer(
        o, named_parameters=named(m), compression=hvd.Compression.bf16), {"tolerance": 2e-2, "sgd_only": True}),
}

for opt_name, (make_optimizer, tolerance) in OPTIMIZERS.items():
    for config_name, (wrap, options) in CONFIGS.items():
        options = dict(options)
        if options.pop("sgd_only", False) and opt_name != "SGD":
            continue  # Adam's first steps are about lr * sign(gradient): rounding a tiny gradient to 0 flips them
        label = f"{opt_name} {config_name}"
        with check(f"training equivalence with the full batch on one process: {label}"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                train_pair(make_optimizer, wrap, label=label, **{"tolerance": tolerance, **options})

with check("DistributedOptimizer is a subclass of the wrapped class with its name; state_dict round trip"):
    model = Net(sync_bn=True).double()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD", type(opt)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    assert {name for name in opt._parameter_names.values()} == {n for n, _ in model.named_parameters()}
    x, y = data(1)
    F.cross_entropy(model(x[0][SHARD]), y[0][SHARD]).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert len(saved["state"]) == len(list(model.parameters()))
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                     named_parameters=model.named_parameters())
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 0.1 and fresh.param_groups[0]["momentum"] == 0.9
    assert all(torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
               for p in model.parameters())

with check("an LR scheduler drives the wrapped optimizer, whether created before or after wrapping"):
    model = nn.Linear(2, 1).double()
    base = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    model(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
    weight = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(weight, model.weight.detach()), "step() did not update the parameters"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # that scheduler watches the unwrapped optimizer's step()
        before.step()
    assert opt.param_groups[0]["lr"] == 0.5
    after = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    model(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
    opt.step()
    after.step()
    assert opt.param_groups[0]["lr"] == 0.25


class Probe(torch.autograd.Function):
    """Identity; its backward records which parameters' allreduces had already started by then."""

    seen = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        Probe.seen = set(Probe.optimizer._pending)
        return grad


with check("allreduces start during backward, as each gradient is ready (overlap)"):
    torch.manual_seed(0)
    first, second = nn.Linear(5, 8).double(), nn.Linear(8, 2).double()
    params = list(first.named_parameters(prefix="first")) + list(second.named_parameters(prefix="second"))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    Probe.optimizer = opt
    x = torch.randn(4, 5, dtype=torch.float64)
    loss = second(Probe.apply(F.relu(first(x)))).sum()
    loss.backward()
    assert Probe.seen == {second.weight, second.bias}, "the last layer's allreduces had not started"
    assert set(opt._pending) == {first.weight, first.bias, second.weight, second.bias}
    opt.step()
    same_on_every_rank(params, "overlap")

with check("a parameter with no gradient on some ranks is still reduced (zeros); no rank waits forever"):
    torch.manual_seed(0)
    trunk, head_a, head_b = nn.Linear(3, 4).double(), nn.Linear(4, 1).double(), nn.Linear(4, 1).double()
    params = [(f"{name}.{p_name}", p) for name, module in (("trunk", trunk), ("a", head_a), ("b", head_b))
              for p_name, p in module.named_parameters()]
    shadow = copy.deepcopy(head_b)  # rank 0's local gradient of head b, computed without collectives
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    x = torch.full((2, 3), float(R + 1), dtype=torch.float64)
    hidden = F.relu(trunk(x))
    loss = head_a(hidden).sum()
    if R == 0:
        loss = loss + head_b(hidden).sum()
        shadow(hidden.detach()).sum().backward()
    loss.backward()
    local = hvd.broadcast(shadow.weight.grad if R == 0 else torch.zeros_like(head_b.weight), 0, name="unused.ref")
    opt.synchronize()
    assert head_b.weight.grad is not None and torch.allclose(head_b.weight.grad, local / N, rtol=1e-12, atol=0)
    with opt.skip_synchronize():
        opt.step()
    same_on_every_rank(params, "unused")

with check("synchronize(), clipping, then step() inside skip_synchronize(); step() after synchronize() warns"):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.full((3, 4), float(R + 1), dtype=torch.float64)
    model(x).pow(2).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    clipped = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    for p, w, g in zip(model.parameters(), weights, clipped):
        assert torch.allclose(p.detach(), w - 0.1 * g, rtol=1e-12, atol=1e-15)
    same_on_every_rank(model.named_parameters(), "clip")
    opt.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    reduced = [p.grad.clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize()"
               in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), reduced)), "gradients reduced twice"

# PyTorch has a GradScaler for CPU tensors from 2.3 (test_torch_training expects one check fewer before).
if hasattr(torch.amp, "GradScaler"):
    with check("torch.amp.GradScaler: synchronize(), unscale_(), then scaler.step() inside skip_synchronize()"):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).double()
        shadow = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        x = torch.full((3, 4), float(R + 1), dtype=torch.float64)
        shadow(x).pow(2).sum().backward()
        expected = [hvd.allreduce(p.grad, name=f"scaler.expected.{i}") for i, p in enumerate(shadow.parameters())]
        scaler.scale(model(x).pow(2).sum()).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        for p, grad in zip(model.parameters(), expected):
            assert torch.allclose(p.grad, grad, rtol=1e-12, atol=0), "unscaled gradients are not the ranks' average"
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        for p, q, grad in zip(model.parameters(), shadow.parameters(), expected):
            assert torch.allclose(p.detach(), q.detach() - 0.1 * grad, rtol=1e-12, atol=1e-15)
        same_on_every_rank(model.named_parameters(), "scaler")


with check("zero_grad() between backward() and step() raises AssertionError; too many backward passes too"):
    model = nn.Linear(4, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    expect_error(AssertionError, "zero_grad.*before optimizer.step", opt.zero_grad)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    spoiled = nn.Linear(4, 2).double()  # the second backward adds into gradients being reduced: discard it
    spoiled_opt = hvd.DistributedOptimizer(torch.optim.SGD(spoiled.parameters(), lr=0.1),
                                           named_parameters=spoiled.named_parameters(prefix="spoiled"))
    spoiled(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    expect_error(AssertionError, "more than backward_passes_per_step",
                 lambda: spoiled(torch.ones(2, 4, dtype=torch.float64)).sum().backward())
    spoiled_opt.synchronize()
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    same_on_every_rank(model.named_parameters(), "accumulate")

with check("sparse gradients: reduced by allgather, or as dense with sparse_as_dense; same as the reference"):
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        reference = nn.Embedding(10, 3, sparse=False).double()
        model = nn.Embedding(10, 3, sparse=True).double()
        model.load_state_dict(reference.state_dict())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
        indices = torch.tensor([[1, 2, 1, 7, 0, 9, 3, 3, 1, 4, 5, 6]] * 2)
        for step in range(2):
            ref_opt.zero_grad()
            reference(indices[step]).pow(2).sum().div(BATCH).backward()
            ref_opt.step()
            opt.zero_grad()
            model(indices[step][SHARD]).pow(2).sum().div(BATCH // N).backward()
            opt.step()
            assert torch.allclose(model.weight, reference.weight, rtol=1e-12, atol=1e-14), (sparse_as_dense, step)
        same_on_every_rank(model.named_parameters(), f"sparse.{sparse_as_dense}")

with check("DistributedOptimizer argument errors"):
    model = nn.Linear(2, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    weight, bias = model.weight, model.bias
    expect_error(ValueError, "Parameter names in named_parameters must be unique. Found duplicates: w",
                 hvd.DistributedOptimizer, base, named_parameters=[("w", weight), ("w", bias)])
    expect_error(ValueError, "sequence of tuples", hvd.DistributedOptimizer, base, named_parameters=[weight, bias])
    expect_error(ValueError, "not named", hvd.DistributedOptimizer, base, named_parameters=[("w", weight)])
    expect_error(ValueError, "gradient_predivide_factor not supported with op != Average",
                 hvd.DistributedOptimizer, base, op=hvd.Sum, gradient_predivide_factor=2.0)
    expect_error(ValueError, "backward_passes_per_step", hvd.DistributedOptimizer, base, backward_passes_per_step=0)
    expect_error(ValueError, "groups", hvd.DistributedOptimizer, base, groups=-1)
    expect_error(ValueError, "groups", hvd.DistributedOptimizer, base, groups=[[1, 2]])
    expect_error(ValueError, "more than one group", hvd.DistributedOptimizer, base, groups=[[weight], [weight]])
    expect_error(TypeError, "torch.optim.Optimizer", hvd.DistributedOptimizer, model)
    expect_error(ValueError, "already a DistributedOptimizer", hvd.DistributedOptimizer,
                 hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), num_groups=1)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)

# ------------------------------------------------------------------------------- broadcasting initial state

with check("broadcast_parameters: state_dict, named_parameters, list of tensors; bad input"):
    torch.manual_seed(R)
    model = Net(sync_bn=True).double()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    same_on_every_rank(model.state_dict().items(), "bp.state_dict")
    torch.manual_seed(R + 10)
    model = Net(sync_bn=True).double()
    hvd.broadcast_parameters(model.named_parameters(), root_rank=N - 1)
    same_tensors = [(n, p) for n, p in model.named_parameters()]
    expected = hvd.broadcast_object({n: p.detach() for n, p in same_tensors} if R == N - 1 else None, N - 1)
    assert all(torch.equal(p.detach(), expected[n]) for n, p in same_tensors)
    tensors = [torch.full((3,), float(R)), torch.full((2, 2), R, dtype=torch.int32)]
    hvd.broadcast_parameters(tensors, root_rank=1)
    assert torch.equal(tensors[0], torch.full((3,), 1.0))
    assert torch.equal(tensors[1], torch.ones(2, 2, dtype=torch.int32))
    expect_error(ValueError, "invalid params of type", hvd.broadcast_parameters, 3, 0)


def state_snapshot(optimizer):
    state = optimizer.state_dict()
    return {"param_groups": state["param_groups"],
            "state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                      for k, s in state["state"].items()}}


def assert_same_structure(got, expected, path="state"):
    if torch.is_tensor(expected):
        assert torch.is_tensor(got) and got.dtype == expected.dtype and torch.equal(got, expected), path
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (path, set(got), set(expected))
        for key in expected:
            assert_same_structure(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), (path, got, expected)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_structure(a, b, f"{path}[{i}]")
    else:
        assert type(got) is type(expected) and got == expected, (path, got, expected)


BROADCAST_OPTIMIZERS = {
    "SGD": lambda p, r: torch.optim.SGD(p, lr=0.1 * (r + 1), momentum=0.5 + 0.1 * r, nesterov=r == 0),
    "Adam": lambda p, r: torch.optim.Adam(p, lr=0.01 * (r + 1), betas=(0.8 + 0.01 * r, 0.99), amsgrad=r == 0),
    "AdamW": lambda p, r: torch.optim.AdamW(p, lr=0.01 * (r + 1), weight_decay=0.1 * r),
    "RMSprop": lambda p, r: torch.optim.RMSprop(p, lr=0.01, momentum=0.1 * r, centered=r == 0),
    "Adagrad": lambda p, r: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01 * r),
    "Adadelta": lambda p, r: torch.optim.Adadelta(p, rho=0.8 + 0.05 * r),
    "Adamax": lambda p, r: torch.optim.Adamax(p, betas=(0.7, 0.9 + 0.01 * r)),
    "NAdam": lambda p, r: torch.optim.NAdam(p, momentum_decay=0.004 * (r + 1)),
    "RAdam": lambda p, r: torch.optim.RAdam(p, lr=0.001 * (r + 1)),
    "ASGD": lambda p, r: torch.optim.ASGD(p, lambd=1e-4 * (r + 1)),
    "Rprop": lambda p, r: torch.optim.Rprop(p, etas=(0.4 + 0.01 * r, 1.2)),
}

for opt_name, make in BROADCAST_OPTIMIZERS.items():
    with check(f"broadcast_optimizer_state {opt_name}: root's hyper-parameters (types kept) and state"):
        torch.manual_seed(R)
        model = nn.Linear(3, 2).double()
        optimizer = make(model.parameters(), R)
        for step in range(R + 1):  # a rank-dependent number of steps on rank-dependent data
            optimizer.zero_grad()
            model(torch.full((2, 3), float(R + step), dtype=torch.float64)).pow(2).sum().backward()
            optimizer.step()
        expected = hvd.broadcast_object(state_snapshot(optimizer) if R == 0 else None, 0, name=f"bos.{opt_name}")
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        assert_same_structure(state_snapshot(optimizer), expected)
    with check(f"broadcast_optimizer_state {opt_name}: a fresh optimizer gets state, parameters unchanged, "
               "zero gradients as Horovod leaves them"):
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = make(model.parameters(), R)
        initialized_by_step = not optimizer.state  # Adagrad makes its state in its constructor
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)), "parameters moved"
        if initialized_by_step:
            assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters()), "no zero gradients"
        else:
            assert all(p.grad is None for p in model.parameters()), "gradients without a state initialisation"
        expected = hvd.broadcast_object(state_snapshot(optimizer) if R == 0 else None, 0, name=f"bos.fresh.{opt_name}")
        assert_same_structure(state_snapshot(optimizer), expected)

with check("broadcast_optimizer_state of a DistributedOptimizer takes no extra collective; LBFGS refused"):
    model = nn.Linear(3, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01 and not opt._pending
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    expect_error(ValueError, "LBFGS", hvd.broadcast_optimizer_state, torch.optim.LBFGS(model.parameters()), 0)

# ------------------------------------------------------------------------------------------- SyncBatchNorm


def sync_bn_case(make_bn, shape_of, label, steps=2, momentum=0.1, affine=True, track=True):
    """Each rank normalizes (rank + 2) samples; the reference normalizes all of them at once."""
    torch.manual_seed(0)
    reference = make_bn(nn, momentum, affine, track)
    sync = hvd.SyncBatchNorm(reference.num_features, momentum=momentum, affine=affine, track_running_stats=track)
    sync.load_state_dict(reference.state_dict())
    if affine:
        with torch.no_grad():
            for module in (reference, sync):
                module.weight.copy_(torch.linspace(0.5, 1.5, reference.num_features))
                module.bias.copy_(torch.linspace(-1, 1, reference.num_features))
    counts = [r + 2 for r in range(N)]
    start = sum(counts[:R])
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        full = torch.randn(sum(counts), *shape_of(), generator=generator) * 3 + 1
        full_grad = torch.randn(full.shape, generator=generator)
        x_ref = full.clone().requires_grad_()
        out_ref = reference(x_ref)
        out_ref.backward(full_grad)
        x = full[start:start + counts[R]].clone().requires_grad_()
        out = sync(x)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.allclose(out, out_ref[start:start + counts[R]], rtol=1e-4, atol=1e-5), f"{label}: forward"
        out.backward(full_grad[start:start + counts[R]])
        assert torch.allclose(x.grad, x_ref.grad[start:start + counts[R]], rtol=1e-4, atol=1e-5), f"{label}: dx"
        if affine:
            for name in ("weight", "bias"):
                total = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum, name=f"bn.{label}.{name}")
                assert torch.allclose(total, getattr(reference, name).grad, rtol=1e-4, atol=1e-5), f"{label}: d{name}"
                getattr(sync, name).grad = None
                getattr(reference, name).grad = None
        if track:
            assert torch.allclose(sync.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6), f"{label}: mean"
            assert torch.allclose(sync.running_var, reference.running_var, rtol=1e-5, atol=1e-6), f"{label}: var"
            assert int(sync.num_batches_tracked) == int(reference.num_batches_tracked) == step + 1
    sync.eval()
    reference.eval()
    probe = torch.randn(3, *shape_of(), generator=torch.Generator().manual_seed(7))
    assert torch.allclose(sync(probe), reference(probe), rtol=1e-5, atol=1e-6), f"{label}: eval"


BN_CASES = {
    "1d (N, C)": (lambda m, mom, a, t: m.BatchNorm1d(5, momentum=mom, affine=a, track_running_stats=t), lambda: (5,)),
    "1d (N, C, L)": (lambda m, mom, a, t: m.BatchNorm1d(3, momentum=mom, affine=a, track_running_stats=t),
                     lambda: (3, 4)),
    "2d": (lambda m, mom, a, t: m.BatchNorm2d(4, momentum=mom, affine=a, track_running_stats=t), lambda: (4, 3, 5)),
    "3d": (lambda m, mom, a, t: m.BatchNorm3d(2, momentum=mom, affine=a, track_running_stats=t),
           lambda: (2, 2, 3, 2)),
}
for case, (make_bn, shape_of) in BN_CASES.items():
    with check(f"SyncBatchNorm {case} matches BatchNorm on the concatenated batch, forward and backward"):
        sync_bn_case(make_bn, shape_of, case)
with check("SyncBatchNorm: momentum=None (cumulative average), affine=False, track_running_stats=False"):
    make_bn, shape_of = BN_CASES["2d"]
    sync_bn_case(make_bn, shape_of, "momentum None", steps=3, momentum=None)
    sync_bn_case(make_bn, shape_of, "affine False", affine=False)
    sync_bn_case(make_bn, shape_of, "no running stats", track=False)
with check("SyncBatchNorm refuses 1-D input"):
    expect_error(ValueError, "expected at least 2D input", hvd.SyncBatchNorm(3), torch.ones(3))

# ------------------------------------------------------------------------------------------- process sets

hvd.shutdown()
subset = hvd.ProcessSet(range(1, N))  # rank 0 stays out, so the set's root is not global rank 0
hvd.init(process_sets=[subset])
if subset.included():
    members, index = subset.ranks, subset.rank()
    with check("ops, gradients and objects on a process set without rank 0"):
        out = hvd.allreduce(torch.full((3,), float(R)), op=hvd.Sum, process_set=subset)
        assert torch.equal(out, torch.full((3,), float(sum(members))))
        x = torch.full((index + 1, 2), float(R), requires_grad=True)
        gathered = hvd.allgather(x, process_set=subset)
        assert gathered.shape == (len(members) * (len(members) + 1) // 2, 2)
        gathered.backward(torch.ones_like(gathered))
        assert torch.equal(x.grad, torch.ones(index + 1, 2))
        root = members[-1]
        assert torch.equal(hvd.broadcast(torch.tensor([R]), root, process_set=subset), torch.tensor([root]))
        out = hvd.alltoall(torch.arange(len(members)) + 10 * R, process_set=subset)
        assert out.tolist() == [10 * m + index for m in members]
        assert hvd.broadcast_object({"from": R} if R == members[0] else None, members[0], process_set=subset) == {
            "from": members[0]}
    with check("DistributedOptimizer (groups=1) and SyncBatchNorm on a process set match the members' full batch"):
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).double()
        model = nn.Sequential(nn.Linear(4, 3), hvd.SyncBatchNorm(3, process_set=subset), nn.Linear(3, 1)).double()
        model.load_state_dict(reference.state_dict())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), groups=1, process_set=subset)
        batches = torch.randn(3, len(members), 4, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        for step in range(3):
            ref_opt.zero_grad()
            reference(batches[step].reshape(-1, 4)).pow(2).mean().backward()
            ref_opt.step()
            opt.zero_grad()
            model(batches[step][index]).pow(2).mean().backward()
            opt.step()
            assert max_difference(model, reference) < 1e-10, max_difference(model, reference)
        for name, tensor in model.state_dict().items():
            assert torch.equal(hvd.broadcast(tensor, members[0], name=f"subset.{name}", process_set=subset), tensor)

hvd.shutdown()
finish(R)
