"""rvod.torch where Horovod scripts rely on its exact behaviour, run by rvodrun with 2 ranks: sparse gradients
that stay sparse (SparseAdam on nn.Embedding(sparse=True), with and without sparse_as_dense and groups, a
rank whose step touches no embedding row) trained against one process on the full batch, and the gradients
broadcast_optimizer_state leaves behind (Horovod's own test_broadcast_state_no_grad, and the cases around it),
and the object helpers with objects over 64 KiB (workers/objects.py covers them at length through the other
shims: every shim serves the same implementation).
"""

import torch
from _check import check, expect_error, finish
from torch import nn

import rvod.torch as hvd

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()
BATCH = 12
SHARD = slice(R * BATCH // N, (R + 1) * BATCH // N)
ROWS, WIDTH = 20, 4


def same_on_every_rank(tensors, label):
    """Every tensor is bit-identical to rank 0's."""
    for name, tensor in tensors:
        reference = hvd.broadcast(tensor.detach(), root_rank=0, name=f"same.{label}.{name}")
        assert torch.equal(reference, tensor.detach()), f"{label}: {name} differs from rank 0's"


class Recommender(nn.Module):
    """A sparse embedding and a dense head; rows whose ``embedded`` flag is off feed a constant feature
    vector instead of their embedding (so a shard can leave the embedding without any gradient)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(ROWS, WIDTH, sparse=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, indices, embedded):
        features = torch.full((len(indices), WIDTH), 0.5, dtype=torch.float64)
        if embedded.any():
            features = features.index_put((embedded.nonzero().squeeze(1),), self.embedding(indices[embedded]))
        return self.head(features).squeeze(1)


def loss_of(model, indices, targets, embedded, rows):
    return (model(indices, embedded) - targets).pow(2).sum().div(rows)


# Three steps of a batch of 12: indices repeat within and across shards; on the last step the second half of
# the batch (rank 1's shard) uses no embedding row at all.
generator = torch.Generator().manual_seed(7)
STEPS = [(torch.randint(0, ROWS, (BATCH,), generator=generator), torch.randn(BATCH, generator=generator,
                                                                            dtype=torch.float64),
          torch.tensor([True] * BATCH if step < 2 else [True] * (BATCH // 2) + [False] * (BATCH // 2)))
         for step in range(3)]


def optimizers(model, distributed, **options):
    sparse = torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.05)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.05)
    if not distributed:
        return sparse, dense
    return (hvd.DistributedOptimizer(sparse, named_parameters=model.embedding.named_parameters(prefix="embedding"),
                                     **options),
            hvd.DistributedOptimizer(dense, named_parameters=model.head.named_parameters(prefix="head"), **options))


for options in ({}, {"sparse_as_dense": True}, {"groups": 1}, {"groups": 1, "sparse_as_dense": True}):
    with check(f"SparseAdam + Adam on a sparse embedding, {options or 'defaults'}: same as one process on the "
               "full batch, identical on every rank, gradients handed to SparseAdam sparse"):
        torch.manual_seed(0)
        reference = Recommender().double()
        model = Recommender().double()
        model.load_state_dict(reference.state_dict())
        reference_optimizers = optimizers(reference, distributed=False)
        distributed_optimizers = optimizers(model, distributed=True, **options)
        for step, (indices, targets, embedded) in enumerate(STEPS):
            for optimizer in reference_optimizers:
                optimizer.zero_grad()
            loss_of(reference, indices, targets, embedded, BATCH).backward()
            for optimizer in reference_optimizers:
                optimizer.step()
            for optimizer in distributed_optimizers:
                optimizer.zero_grad()
            loss_of(model, indices[SHARD], targets[SHARD], embedded[SHARD], BATCH // N).backward()
            for optimizer in distributed_optimizers:
                optimizer.step()
            grad = model.embedding.weight.grad
            assert grad is not None and grad.is_sparse, (step, None if grad is None else grad.layout)
            for name, value in reference.state_dict().items():
                difference = float((model.state_dict()[name] - value).abs().max())
                assert difference < 1e-12, f"step {step}: {name} differs from the reference by {difference}"
        same_on_every_rank(model.named_parameters(), f"sparse-adam.{sorted(options.items())}")

with check("Horovod's test_sparse_embeddings: shards of different lengths, SparseAdam, sparse_as_dense both ways"):
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 3, sparse=True)
        inputs = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if R == 0 else torch.LongTensor([[1, 3, 4], [4, 7, 9]])
        optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                             sparse_as_dense=sparse_as_dense)
        optimizer.zero_grad()
        embedding(inputs).sum().backward()
        optimizer.step()
        same_on_every_rank(embedding.named_parameters(), f"test_sparse_embeddings.{sparse_as_dense}")

with check("a sparse gradient with an op other than Average or Sum is refused by name"):
    embedding = nn.Embedding(4, 2, sparse=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1), op=hvd.Sum)
    embedding(torch.tensor([0, 1])).sum().backward()
    optimizer.step()  # Sum is fine
    expect_error(ValueError, "sparse_allreduce_async supports only Sum and Average", hvd.sparse_allreduce_async,
                 embedding.weight.grad, "sparse.max", hvd.Max)


class ModelNoGrad(nn.Module):
    """Horovod's test_broadcast_state_no_grad model: an integer parameter without gradient, a float one."""

    def __init__(self, a, b):
        super().__init__()
        self.a = nn.Parameter(a.int(), requires_grad=False)
        self.b = nn.Parameter(b)

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


with check("Horovod's test_broadcast_state_no_grad: the trainable parameter gets a zero gradient to broadcast"):
    model = ModelNoGrad(torch.Tensor([1, 3]), torch.rand(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = optimizer.param_groups[0]["params"][1].grad
    assert optimizer.param_groups[0]["params"][0].grad is None
    assert grad is not None and torch.equal(grad, torch.zeros(4)), grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    assert torch.all(torch.eq(grad, bgrad)).item()

with check("broadcast_optimizer_state: computed gradients and parameter values stay; fresh optimizers on "
           "other ranks take the root's state and get zero gradients too"):
    torch.manual_seed(1)
    model = nn.Linear(3, 2).double()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    if R == 0:  # only the root has trained: its state is not empty, and it has a gradient now
        model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
        optimizer.step()
        model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    before = {name: (p.detach().clone(), None if p.grad is None else p.grad.clone())
              for name, p in model.named_parameters()}
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for name, p in model.named_parameters():
        value, grad = before[name]
        assert torch.equal(p.detach(), value), f"{name} moved"
        if R == 0:
            assert torch.equal(p.grad, grad), f"{name}: the root's gradient changed"
        else:
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), f"{name}: {p.grad}"
        assert int(optimizer.state[p]["step"]) == 1, optimizer.state[p]["step"]
        same_on_every_rank([(f"{name}.exp_avg", optimizer.state[p]["exp_avg"])], "adamw-state")

with check("broadcast_optimizer_state with SparseAdam: zero gradients are sparse, and training goes on"):
    torch.manual_seed(2)
    embedding = nn.Embedding(6, 2, sparse=True)
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                         named_parameters=embedding.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = embedding.weight.grad
    assert grad is not None and grad.is_sparse and grad.to_dense().abs().sum() == 0, grad
    optimizer.zero_grad()
    embedding(torch.tensor([R, 5])).sum().backward()
    optimizer.step()
    same_on_every_rank(embedding.named_parameters(), "sparse-adam-after-broadcast")

with check("broadcast_object and allgather_object carry objects over 64 KiB, torch tensors included"):
    tensor = torch.arange(300_000, dtype=torch.float32) * (R + 1)
    got = hvd.broadcast_object({"tensor": tensor, "text": "x" * 70_000 * (R + 1)}, root_rank=N - 1)
    assert torch.equal(got["tensor"], torch.arange(300_000, dtype=torch.float32) * N) and len(got["text"]) == 70_000 * N
    gathered = hvd.allgather_object(tensor[: 100_000 * (R + 1)])
    assert [len(g) for g in gathered] == [100_000 * (r + 1) for r in range(N)]
    assert all(torch.equal(g, torch.arange(100_000 * (r + 1), dtype=torch.float32) * (r + 1))
               for r, g in enumerate(gathered))

finish(R)
