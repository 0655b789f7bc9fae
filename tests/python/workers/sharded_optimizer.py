"""DistributedOptimizer(sharded=True) of rvod.torch, run by rvodrun with 2, 3 or 4 ranks.

Usage: sharded_optimizer.py DIR [PREVIOUS_SIZE]. Every rank trains the same model twice on its rows of the
batch, with a sharded and with a plain DistributedOptimizer, and checks: equal parameters after 200 steps
of Adam, AdamW and SGD with momentum; the state each rank holds is 1/N of the plain one's; the options
(backward_passes_per_step, gradient_predivide_factor, fp16 compression, groups, sparse_as_dense, Sum);
gradients dropped once sent; state dict round trip, consolidation (equal to the plain optimizer's, loadable
by a plain torch optimizer); broadcast_parameters and broadcast_optimizer_state; refusals. It saves every
rank's sharded state dict and the consolidated one under DIR/<size>/; given PREVIOUS_SIZE, it first loads
the shards a job of that size saved there and checks the resharded state equals the one it consolidated.
"""

import copy
import os
import sys

import torch
from _check import check, expect_error, finish
from torch import nn

import rvod.torch as hvd

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()
DIR = sys.argv[1]
PREVIOUS = int(sys.argv[2]) if len(sys.argv) > 2 else None
STEPS = 200
ROWS = 4  # rows per rank


class Net(nn.Module):
    """Odd sizes, so chunks are uneven, and a bias smaller than 4 ranks (some ranks own none of it)."""

    def __init__(self, sparse=False):
        super().__init__()
        self.embed = nn.Embedding(11, 6, sparse=sparse)
        self.hidden = nn.Linear(6, 13)
        self.out = nn.Linear(13, 3)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens).mean(dim=1))))


def batch(step):
    generator = torch.Generator().manual_seed(1000 * step + R)
    return torch.randint(0, 11, (ROWS, 5), generator=generator), torch.randn(ROWS, 3, generator=generator)


def named(model, prefix):
    return [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]


def train(model, optimizer, steps, first=0, passes=1):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        for micro in range(passes):
            tokens, target = batch(step * passes + micro)
            nn.functional.mse_loss(model(tokens), target).backward()
        optimizer.step()


def max_difference(a, b):
    return max(float((x.detach().double() - y.detach().double()).abs().max()) for x, y in
               zip(a.parameters(), b.parameters()))


def same_on_every_rank(model, label):
    for name, p in model.named_parameters():
        root = hvd.broadcast(p.detach(), root_rank=0, name=f"same.{label}.{name}")
        assert torch.equal(root, p.detach()), f"{label}: {name} differs from rank 0's"


def state_elements(optimizer):
    """Elements of the optimizer's own per-element state tensors (those the size of a parameter it holds)."""
    sizes = {p: p.numel() for group in optimizer.param_groups for p in group["params"]}
    return sum(v.numel() for p, state in optimizer.state.items() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0 and v.numel() == sizes[p])


def pair(make, seed, prefix, sparse=False, **options):
    """A model with a sharded DistributedOptimizer and an identical one with a plain DistributedOptimizer."""
    torch.manual_seed(seed)
    model = Net(sparse)
    reference = copy.deepcopy(model)
    sharded = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=named(model, f"{prefix}.s"),
                                       sharded=True, **options)
    plain = hvd.DistributedOptimizer(make(reference.parameters()), named_parameters=named(reference, f"{prefix}.p"),
                                     **options)
    return model, sharded, reference, plain


OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}
TOTAL = sum(p.numel() for p in Net().parameters())
PARAMS = len(list(Net().parameters()))

# -------------------------------------------------------------------------- resharding a previous job's

if PREVIOUS is not None:
    with check(f"the {PREVIOUS} shards of a job of {PREVIOUS} ranks load resharded into {N} ranks"):
        model, sharded, _, _ = pair(OPTIMIZERS["Adam"], 0, "reshard")
        shards = [torch.load(os.path.join(DIR, str(PREVIOUS), f"shard{r}.pt")) for r in range(PREVIOUS)]
        whole = torch.load(os.path.join(DIR, str(PREVIOUS), "consolidated.pt"))
        sharded.load_state_dict(shards)
        again = sharded.consolidate_state_dict(to=None)
        assert again["param_groups"] == whole["param_groups"]
        assert again["state"].keys() == whole["state"].keys()
        for index, entry in whole["state"].items():
            for key, value in entry.items():
                assert torch.equal(again["state"][index][key], value), f"{index}.{key} changed by resharding"
        expect_error(ValueError, rf"rank {min(R, PREVIOUS - 1)}'s shard of a sharded optimizer of {PREVIOUS} "
                     rf"ranks; this one is rank {R} of {N}", sharded.load_state_dict, shards[min(R, PREVIOUS - 1)])

# ------------------------------------------------------------------ sharded equals plain, 200 steps each

PAIRS = {label: pair(make, 1, label) for label, make in OPTIMIZERS.items()}
for step in range(STEPS):  # all six in lockstep, so the engine fuses their reductions
    for model, sharded, reference, plain in PAIRS.values():
        for network, optimizer in ((model, sharded), (reference, plain)):
            optimizer.zero_grad()
            tokens, target = batch(step)
            nn.functional.mse_loss(network(tokens), target).backward()
    for model, sharded, reference, plain in PAIRS.values():
        plain.step()
        sharded.step()
for label, (model, sharded, reference, plain) in PAIRS.items():
    with check(f"{label}: {STEPS} steps sharded equal the plain DistributedOptimizer's"):
        difference = max_difference(model, reference)
        assert difference < 2e-5, f"{label}: parameters differ by {difference}"
        same_on_every_rank(model, label)
    with check(f"{label}: the state held here is 1/{N} of the plain optimizer's"):
        mine, whole = state_elements(sharded), state_elements(plain)
        keys = 1 if label == "SGD" else 2
        assert whole == keys * TOTAL, (whole, TOTAL)
        assert mine <= keys * (TOTAL // N + PARAMS), f"{mine} elements of state here, the plain one {whole}"
        total = int(hvd.allreduce(torch.tensor(mine), op=hvd.Sum, name=f"state.{label}"))
        assert total == whole, f"the ranks hold {total} elements of state together, the plain one {whole}"
    with check(f"{label}: the consolidated state dict is the plain optimizer's, on rank 0 only"):
        whole = sharded.consolidate_state_dict(to=0)
        if R == 0:
            expected = plain.state_dict()
            assert whole["param_groups"] == expected["param_groups"]
            for index, entry in expected["state"].items():
                for key, value in entry.items():
                    got = whole["state"][index][key]
                    assert torch.allclose(got, value, atol=1e-6) if torch.is_tensor(value) else got == value, key
        else:
            assert whole is None

# ---------------------------------------------------------------------------- the optimizer's options

OPTIONS = {
    "backward_passes_per_step=2": dict(backward_passes_per_step=2),
    "gradient_predivide_factor=2": dict(gradient_predivide_factor=2.0),
    "compression=fp16": dict(compression=hvd.Compression.fp16),
    "groups=2": dict(groups=2),
    "op=Sum": dict(op=hvd.Sum),
}
for label, options in OPTIONS.items():
    with check(f"{label}: sharded equals plain"):
        model, sharded, reference, plain = pair(OPTIMIZERS["Adam"], 2, label.split("=")[0], **options)
        passes = options.get("backward_passes_per_step", 1)
        train(model, sharded, 10, passes=passes)
        train(reference, plain, 10, passes=passes)
        difference = max_difference(model, reference)
        assert difference < (1e-3 if "fp16" in label else 2e-6), f"{label}: parameters differ by {difference}"

with check("sparse_as_dense=True: an nn.Embedding(sparse=True) trains as the plain optimizer does"):
    model, sharded, reference, plain = pair(lambda params: torch.optim.SGD(params, lr=0.05), 3, "sparse", sparse=True,
                                            sparse_as_dense=True)
    train(model, sharded, 10)
    train(reference, plain, 10)
    assert max_difference(model, reference) < 2e-6

with check("gradients are dropped once sent; the shard's .grad holds the reduced chunk"):
    model, sharded, _, _ = pair(OPTIMIZERS["SGD"], 4, "zero2")
    tokens, target = batch(0)
    nn.functional.mse_loss(model(tokens), target).backward()
    sharded.synchronize()
    assert all(p.grad is None for p in model.parameters())
    shards = [p for group in sharded.param_groups for p in group["params"]]
    assert sum(p.grad.numel() for p in shards) == sum(p.numel() for p in shards) <= TOTAL // N + PARAMS
    with sharded.skip_synchronize():
        sharded.step()
    same_on_every_rank(model, "zero2")

# ------------------------------------------------------------------------------------------ state dicts

with check("state_dict round trip: a new sharded optimizer continues exactly where the first left off"):
    model, sharded, reference, plain = pair(OPTIMIZERS["Adam"], 5, "trip")
    train(model, sharded, 5)
    train(reference, plain, 5)
    saved = sharded.state_dict()
    assert saved["rvod_sharded"]["size"] == N and saved["rvod_sharded"]["rank"] == R
    model = copy.deepcopy(model)  # the first optimizer's hooks stay on the first model
    again = hvd.DistributedOptimizer(OPTIMIZERS["Adam"](model.parameters()), named_parameters=named(model, "trip.t"),
                                     sharded=True)
    again.load_state_dict(saved)
    train(model, again, 5, first=5)
    train(reference, plain, 5, first=5)
    assert max_difference(model, reference) < 2e-6

with check("a consolidated state dict loads into a plain torch optimizer and into a sharded one"):
    model, sharded, reference, plain = pair(OPTIMIZERS["AdamW"], 6, "whole")
    train(model, sharded, 5)
    train(reference, plain, 5)
    whole = sharded.consolidate_state_dict(to=None)
    copy_model = copy.deepcopy(model)
    local = torch.optim.AdamW(copy_model.parameters(), lr=0.01, weight_decay=0.1)
    local.load_state_dict(whole)
    resumed = hvd.DistributedOptimizer(local, named_parameters=named(copy_model, "whole.l"), sharded=True)
    train(copy_model, resumed, 5, first=5)
    train(reference, plain, 5, first=5)
    assert max_difference(copy_model, reference) < 2e-6

with check("broadcast_optimizer_state sends a consolidated dict loaded on rank 0 alone"):
    model, sharded, reference, plain = pair(OPTIMIZERS["Adam"], 7, "bcast")
    train(reference, plain, 3)
    model = copy.deepcopy(model)
    fresh = hvd.DistributedOptimizer(OPTIMIZERS["Adam"](model.parameters()), named_parameters=named(model, "bcast.f"),
                                     sharded=True)
    if R == 0:
        fresh.load_state_dict(plain.state_dict())
        for group in fresh.param_groups:
            group["lr"] = 0.02
    hvd.broadcast_parameters(reference.state_dict(), root_rank=0)
    model.load_state_dict(reference.state_dict())
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert all(group["lr"] == 0.02 for group in fresh.param_groups)
    for group in plain.param_groups:
        group["lr"] = 0.02
    train(model, fresh, 3, first=3)
    train(reference, plain, 3, first=3)
    assert max_difference(model, reference) < 2e-6

with check("broadcast_parameters: the next step starts from the broadcast values"):
    model, sharded, reference, plain = pair(OPTIMIZERS["SGD"], 8, "params")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(R)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, sharded, 3)
    train(reference, plain, 3)
    assert max_difference(model, reference) < 2e-6

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
    tokens, target = batch(0)
    expect_error(ValueError, r"cannot shard the sparse gradient of sp.embed.weight: .* pass sparse_as_dense=True",
                 lambda: nn.functional.mse_loss(model(tokens), target).backward())

# ------------------------------------------------------------------- saved for a job of another size

with check(f"every rank's shard and the consolidated state dict are saved under {N}/"):
    model, sharded, _, _ = pair(OPTIMIZERS["Adam"], 9, "save")
    train(model, sharded, 3)
    os.makedirs(os.path.join(DIR, str(N)), exist_ok=True)
    torch.save(sharded.state_dict(), os.path.join(DIR, str(N), f"shard{R}.pt"))
    whole = sharded.consolidate_state_dict(to=0)
    if R == 0:
        torch.save(whole, os.path.join(DIR, str(N), "consolidated.pt"))
    hvd.barrier()

finish(R)
