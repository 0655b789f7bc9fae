"""DistributedOptimizer(sharded=True) of rvod.torch, run by rvodrun with 4 ranks.

Usage: sharded_optimizer.py DIR. The job registers the process sets {0, 1} and {0, 1, 2}, so every check that
needs a world of 2, 3 or 4 ranks runs on the set of that size, in this one job (each rank runs those it
belongs to). Every sharded model is compared with a reference trained in this process by a plain torch
optimizer on the whole batch of its world (the rows of every rank of the set): what sharded=False computes.
Checks: 200 steps of Adam, AdamW and SGD with momentum on 2, 3 and 4 ranks give the reference's parameters,
equal on every rank; the state each rank holds is 1/N of the reference's; the consolidated state dict is
the reference optimizer's. With the plain DistributedOptimizer side by side: the options keep their meaning
(backward_passes_per_step, gradient_predivide_factor, fp16 compression, groups, Sum, sparse_as_dense).
Then: gradients dropped once sent; clip_grad_norm_; state dict round trip; a consolidated dict loads into a plain torch
optimizer; broadcast_parameters and broadcast_optimizer_state; refusals; the shards of the 4-rank Adam,
saved under DIR, load resharded into the 2-rank set and those into the 3-rank set (4 -> 2 -> 3). Runs that
are independent train in lockstep, so the engine fuses their collectives.
"""

import copy
import os
import sys

import torch
from _check import check, expect_error, finish
from torch import nn

import rvod.torch as hvd

PAIR, TRIO = hvd.ProcessSet([0, 1]), hvd.ProcessSet([0, 1, 2])
hvd.init(process_sets=[PAIR, TRIO])
torch.set_num_threads(1)
R = hvd.rank()
assert hvd.size() == 4, "run with -np 4"
DIR = sys.argv[1]
WORLDS = {4: hvd.global_process_set, 3: TRIO, 2: PAIR}
MINE = {n: ps for n, ps in WORLDS.items() if ps.included()}
STEPS = 200
ROWS = 4  # rows per rank


OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}

class Net(nn.Module):
    """Few operations (the checks are many), odd sizes, so chunks are uneven, and a bias smaller than 4 ranks
    (some ranks own none of it)."""

    def __init__(self, sparse=False):
        super().__init__()
        self.embed = nn.Embedding(11, 6, sparse=sparse)
        self.out = nn.Linear(6, 3)

    def forward(self, tokens):
        return self.out(self.embed(tokens).mean(dim=1))


class Trio(nn.Module):
    """One Net per optimizer of OPTIMIZERS, trained by one backward pass of the sum of their losses."""

    def __init__(self):
        super().__init__()
        self.nets = nn.ModuleDict({label: Net() for label in OPTIMIZERS})

    def forward(self, tokens):
        return torch.stack([net(tokens) for net in self.nets.values()])


def batch(step, rank=R):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 11, (ROWS, 5), generator=generator), torch.randn(ROWS, 3, generator=generator)


def whole_batch(step, ranks):
    """The rows of every rank of a world: the mean loss over them is the mean of the ranks' mean losses."""
    rows = [batch(step, r) for r in ranks]
    return torch.cat([tokens for tokens, _ in rows]), torch.cat([target for _, target in rows])


def backward(model, rows):
    """The loss's gradient; a Trio's is the sum of its Nets' (each trained on its own loss)."""
    output = model(rows[0])
    nn.functional.mse_loss(output, rows[1].expand_as(output), reduction="sum").div(rows[1].numel()).backward()


def named(model, prefix):
    return [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]


def lockstep(runs, steps, first=0):
    """Train every run ``(model, optimizer, ranks, passes)`` ``steps`` steps, their steps interleaved: a run
    whose ``ranks`` is None trains on this rank's rows, else (a reference) on the whole batch of those ranks."""
    for step in range(first, first + steps):
        for model, optimizer, ranks, passes in runs:
            optimizer.zero_grad()
            for micro in range(passes):
                index = step * passes + micro
                backward(model, batch(index) if ranks is None else whole_batch(index, ranks))
        for _, optimizer, _, _ in runs:
            optimizer.step()


def train(model, optimizer, steps, first=0, ranks=None):
    lockstep([(model, optimizer, ranks, 1)], steps, first)


def max_difference(a, b):
    """Read by ``state_dict()``, which waits for a sharded optimizer's allgather of the last step."""
    a, b = a.state_dict(), b.state_dict()
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


def same_on_every_rank(model, label, process_set=hvd.global_process_set):
    for name, p in model.state_dict().items():
        root = hvd.broadcast(p.detach(), root_rank=0, name=f"same.{label}.{name}", process_set=process_set)
        assert torch.equal(root, p.detach()), f"{label}: {name} differs from rank 0's"


def state_elements(optimizer):
    """Elements of the optimizer's own per-element state tensors (those the size of a parameter it holds)."""
    sizes = {p: p.numel() for group in optimizer.param_groups for p in group["params"]}
    return sum(v.numel() for p, state in optimizer.state.items() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0 and v.numel() == sizes[p])


def with_reference(make, seed, prefix, sparse=False, process_set=hvd.global_process_set, **options):
    """A model with a sharded DistributedOptimizer, and an identical reference model with a plain torch one."""
    torch.manual_seed(seed)
    model = Net(sparse)
    reference = copy.deepcopy(model)
    sharded = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=named(model, f"{prefix}.s"),
                                       sharded=True, process_set=process_set, **options)
    return model, sharded, reference, make(reference.parameters())


def with_plain(make, seed, prefix, sparse=False, **options):
    """A model with a sharded DistributedOptimizer and an identical one with a plain DistributedOptimizer."""
    model, sharded, reference, _ = with_reference(make, seed, prefix, sparse, **options)
    plain = hvd.DistributedOptimizer(make(reference.parameters()), named_parameters=named(reference, f"{prefix}.p"),
                                     **options)
    return model, sharded, reference, plain


SPARSE_SGD = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731 - sparse gradients: no weight decay
TOTAL = sum(p.numel() for p in Net().parameters())
PARAMS = len(list(Net().parameters()))
EVERYONE = list(range(4))

# ------------------------------------------------- 200 steps on 2, 3 and 4 ranks equal the reference's

CHECKER = {n: ps.ranks[-1] for n, ps in WORLDS.items()}  # computes world n's reference: 3, 2, 1 (balanced)
TRIOS = {}  # n -> (Trio, {label: sharded optimizer}, reference Trio or None, {label: torch optimizer})
for n, ps in MINE.items():
    torch.manual_seed(1)
    trio = Trio()
    reference = copy.deepcopy(trio)
    TRIOS[n] = (trio, {label: hvd.DistributedOptimizer(make(trio.nets[label].parameters()), sharded=True,
                                                       named_parameters=named(trio.nets[label], f"{n}.{label}"),
                                                       process_set=ps) for label, make in OPTIMIZERS.items()},
                reference, {label: make(reference.nets[label].parameters()) for label, make in OPTIMIZERS.items()})
for step in range(STEPS):
    for n, (trio, sharded, reference, local) in TRIOS.items():
        for optimizer in sharded.values():
            optimizer.zero_grad()
        backward(trio, batch(step))
        if R == CHECKER[n]:
            for optimizer in local.values():
                optimizer.zero_grad()
            backward(reference, whole_batch(step, WORLDS[n].ranks))
    for n, (trio, sharded, reference, local) in TRIOS.items():
        for label in OPTIMIZERS:
            sharded[label].step()
            if R == CHECKER[n]:
                local[label].step()
RUNS = {(n, label): (trio.nets[label], sharded[label], reference.nets[label], local[label])
        for n, (trio, sharded, reference, local) in TRIOS.items() for label in OPTIMIZERS}
for (n, label), (model, sharded, reference, local) in RUNS.items():
    ps = WORLDS[n]
    with check(f"{label} on {n} ranks: {STEPS} steps give the parameters of the whole batch's, on every rank"):
        if R == CHECKER[n]:
            difference = max_difference(model, reference)
            assert difference < 2e-5, f"{label} on {n} ranks: parameters differ by {difference}"
        same_on_every_rank(model, f"{n}.{label}", ps)
    with check(f"{label} on {n} ranks: the state held here is 1/{n} of the whole optimizer's"):
        mine, keys = state_elements(sharded), 1 if label == "SGD" else 2
        whole = keys * TOTAL  # Adam's two moments, SGD's momentum: one element per parameter element each
        assert mine <= keys * (TOTAL // n + PARAMS), f"{mine} elements of state here, the whole one {whole}"
        total = int(hvd.allreduce(torch.tensor(mine), op=hvd.Sum, name=f"state.{n}.{label}", process_set=ps))
        assert total == whole, f"the ranks hold {total} elements of state together, the whole one {whole}"
        if R == CHECKER[n]:
            assert state_elements(local) == whole, (state_elements(local), whole)
    with check(f"{label} on {n} ranks: the consolidated state dict is the whole optimizer's, on one rank only"):
        consolidated = sharded.consolidate_state_dict(to=CHECKER[n])
        if R == CHECKER[n]:
            expected = local.state_dict()
            assert consolidated["param_groups"] == expected["param_groups"]
            assert consolidated["state"].keys() == expected["state"].keys()
            for index, entry in expected["state"].items():
                for key, value in entry.items():
                    got = consolidated["state"][index][key]
                    assert torch.allclose(got, value, atol=1e-5) if torch.is_tensor(value) else got == value, key
        else:
            assert consolidated is None

# ------------------------------------------- the options keep their meaning: sharded equals plain

OPTIONS = {
    "backward_passes_per_step=2": dict(backward_passes_per_step=2),
    "gradient_predivide_factor=2": dict(gradient_predivide_factor=2.0),
    "compression=fp16": dict(compression=hvd.Compression.fp16),
    "groups=2": dict(groups=2),
    "op=Sum": dict(op=hvd.Sum),
    "sparse_as_dense=True": dict(sparse_as_dense=True),
}
PAIRS = {label: with_plain(SPARSE_SGD if "sparse" in label else OPTIMIZERS["Adam"], 2, label.split("=")[0],
                           sparse="sparse" in label, **options) for label, options in OPTIONS.items()}
lockstep([run for label, (model, sharded, reference, plain) in PAIRS.items()
          for passes in [OPTIONS[label].get("backward_passes_per_step", 1)]
          for run in ((model, sharded, None, passes), (reference, plain, None, passes))], 10)
for label, (model, sharded, reference, plain) in PAIRS.items():
    with check(f"{label}: sharded equals plain"):
        difference = max_difference(model, reference)
        assert difference < (1e-3 if "fp16" in label else 2e-6), f"{label}: parameters differ by {difference}"

with check("gradients are dropped once sent; the shard's .grad holds the reduced chunk"):
    model, sharded, _, _ = with_reference(OPTIMIZERS["SGD"], 4, "zero2")
    backward(model, batch(0))
    sharded.synchronize()
    assert all(p.grad is None for p in model.parameters())
    shards = [p for group in sharded.param_groups for p in group["params"]]
    assert sum(p.grad.numel() for p in shards) == sum(p.numel() for p in shards) <= TOTAL // 4 + PARAMS
    with sharded.skip_synchronize():
        sharded.step()
    same_on_every_rank(model, "zero2")

with check("clip_grad_norm_ clips by the whole model's gradient norm, as torch's clip_grad_norm_ does"):
    model, sharded, reference, local = with_reference(OPTIMIZERS["Adam"], 10, "clip")
    for step in range(3):
        sharded.zero_grad()
        local.zero_grad()
        backward(model, batch(step))
        backward(reference, whole_batch(step, EVERYONE))
        sharded.synchronize()
        norm = sharded.clip_grad_norm_(0.05)
        expected = nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        assert expected > 0.05 and abs(float(norm) - float(expected)) < 1e-5 * float(expected), (norm, expected)
        with sharded.skip_synchronize():
            sharded.step()
        local.step()
    assert max_difference(model, reference) < 2e-5
    backward(model, batch(3))
    expect_error(RuntimeError, r"call optimizer.synchronize\(\) first", sharded.clip_grad_norm_, 1.0)
    sharded.synchronize()

# ------------------------------------------------------------------------------------------ state dicts

with check("state_dict round trip: a new sharded optimizer continues exactly where the first left off"):
    model, sharded, reference, local = with_reference(OPTIMIZERS["Adam"], 5, "trip")
    lockstep([(model, sharded, None, 1), (reference, local, EVERYONE, 1)], 5)
    saved = sharded.state_dict()
    assert saved["rvod_sharded"]["size"] == 4 and saved["rvod_sharded"]["rank"] == R
    sharded.wait_for_parameters()  # deepcopy reads the parameters themselves
    model = copy.deepcopy(model)  # the first optimizer's hooks stay on the first model
    again = hvd.DistributedOptimizer(OPTIMIZERS["Adam"](model.parameters()), named_parameters=named(model, "trip.t"),
                                     sharded=True)
    again.load_state_dict(saved)
    lockstep([(model, again, None, 1), (reference, local, EVERYONE, 1)], 5, first=5)
    assert max_difference(model, reference) < 2e-5

with check("a consolidated state dict loads into a plain torch optimizer and into a sharded one"):
    model, sharded, reference, local = with_reference(OPTIMIZERS["AdamW"], 6, "whole")
    lockstep([(model, sharded, None, 1), (reference, local, EVERYONE, 1)], 5)
    consolidated = sharded.consolidate_state_dict(to=None)
    sharded.wait_for_parameters()  # deepcopy reads the parameters themselves
    copy_model = copy.deepcopy(model)
    plain_torch = torch.optim.AdamW(copy_model.parameters(), lr=0.01, weight_decay=0.1)
    plain_torch.load_state_dict(consolidated)
    resumed = hvd.DistributedOptimizer(plain_torch, named_parameters=named(copy_model, "whole.l"), sharded=True)
    lockstep([(copy_model, resumed, None, 1), (reference, local, EVERYONE, 1)], 5, first=5)
    assert max_difference(copy_model, reference) < 2e-5

with check("broadcast_optimizer_state sends a consolidated dict loaded on rank 0 alone"):
    model, sharded, reference, local = with_reference(OPTIMIZERS["Adam"], 7, "bcast")
    train(reference, local, 3, ranks=EVERYONE)
    if R == 0:
        sharded.load_state_dict(local.state_dict())
        for group in sharded.param_groups:
            group["lr"] = 0.02
    model.load_state_dict(reference.state_dict())
    hvd.broadcast_optimizer_state(sharded, root_rank=0)
    assert all(group["lr"] == 0.02 for group in sharded.param_groups)
    for group in local.param_groups:
        group["lr"] = 0.02
    lockstep([(model, sharded, None, 1), (reference, local, EVERYONE, 1)], 3, first=3)
    assert max_difference(model, reference) < 2e-5

with check("broadcast_parameters: the next step starts from the broadcast values"):
    model, sharded, reference, local = with_reference(OPTIMIZERS["SGD"], 8, "params")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(R)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    lockstep([(model, sharded, None, 1), (reference, local, EVERYONE, 1)], 3)
    assert max_difference(model, reference) < 2e-5

# ------------------------------------------------------------------------------------------- refusals

with check("refusals: Adasum, LBFGS, SparseAdam, a sparse gradient without sparse_as_dense"):
    model = Net(sparse=True)
    expect_error(ValueError, r"sharded=True does not take op=Adasum: Adasum combines whole parameter updates",
                 hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, sharded=True)
    expect_error(ValueError, r"cannot shard torch.optim.LBFGS: LBFGS evaluates the whole model",
                 hvd.DistributedOptimizer, torch.optim.LBFGS(model.parameters()), sharded=True)
    expect_error(ValueError, r"cannot shard torch.optim.SparseAdam: SparseAdam takes sparse gradients",
                 hvd.DistributedOptimizer, torch.optim.SparseAdam(list(model.embed.parameters())), sharded=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=named(model, "sp"),
                                         sharded=True)
    expect_error(ValueError, r"cannot shard the sparse gradient of sp.embed.weight: .* pass sparse_as_dense=True",
                 backward, model, batch(0))

# ------------------------------------------------------------- resharding 4 -> 2 -> 3 ranks, by files


def saved_shards(n):
    return [torch.load(os.path.join(DIR, str(n), f"shard{r}.pt")) for r in range(n)]


def reloaded(n, previous, expected):
    """A fresh sharded Adam on the set of ``n`` ranks loads the shards the set of ``previous`` ranks saved;
    its consolidated state must be ``expected``; it saves its own shards."""
    model = Net()
    resharded = hvd.DistributedOptimizer(OPTIMIZERS["Adam"](model.parameters()), sharded=True,
                                         named_parameters=named(model, f"reshard.{n}"), process_set=WORLDS[n])
    shards = saved_shards(previous)
    resharded.load_state_dict(shards)
    again = resharded.consolidate_state_dict(to=None)
    torch.save(resharded.state_dict(), os.path.join(DIR, str(n), f"shard{WORLDS[n].rank()}.pt"))
    assert again["param_groups"] == expected["param_groups"]
    assert again["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][index][key], value), f"{index}.{key} changed by resharding"
    mine = WORLDS[n].rank()
    expect_error(ValueError, rf"rank {min(mine, previous - 1)}'s shard of a sharded optimizer of {previous} ranks; "
                 rf"this one is rank {mine} of {n}", resharded.load_state_dict, shards[min(mine, previous - 1)])


with check("the shards of the 4-rank Adam load resharded into 2 ranks, and those into 3 ranks"):
    for n in WORLDS:
        os.makedirs(os.path.join(DIR, str(n)), exist_ok=True)
    sharded = RUNS[(4, "Adam")][1]
    torch.save(sharded.state_dict(), os.path.join(DIR, "4", f"shard{R}.pt"))
    expected = sharded.consolidate_state_dict(to=None)
    hvd.barrier()
    try:
        if PAIR.included():
            reloaded(2, 4, expected)
    finally:
        hvd.barrier()
    if TRIO.included():
        reloaded(3, 2, expected)

finish(R)
