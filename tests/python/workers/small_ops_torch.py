"""Small synchronous rvod.torch ops in steady state (the fast lane once cached, the DLPack path for what NumPy
cannot view): values, dtypes, new tensors or the input itself, gradients. 2 ranks. Used by test_small_ops.py."""

import torch
from _check import check, finish

import rvod.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()

for step in range(20):
    x = torch.tensor([rank + step, 2.0 * rank], dtype=torch.float32)
    y = hvd.allreduce(x, op=hvd.Sum, name="t.sum")
    z = hvd.allreduce_(torch.full((2, 2), float(rank), dtype=torch.float64), op=hvd.Max, name="t.max_")
    h = hvd.allreduce(torch.ones(3, dtype=torch.float16) * (rank + 1), op=hvd.Sum, name="t.half")
    bf = hvd.allreduce(torch.ones(3, dtype=torch.bfloat16) * (rank + 1), op=hvd.Sum, name="t.bf16")
    flags = hvd.allreduce(torch.tensor([rank == 0, False]), op=hvd.Max, name="t.bool")
    b = hvd.broadcast(torch.arange(4) + rank, root_rank=0, name="t.bcast")
    b_ = torch.zeros(3, dtype=torch.int32) + rank
    same = hvd.broadcast_(b_, root_rank=size - 1, name="t.bcast_")
    g = hvd.allgather(torch.tensor([[rank, step]], dtype=torch.int64), name="t.gather")
    g16 = hvd.allgather(torch.full((2,), rank + 0.5, dtype=torch.float16), name="t.gather16")
with check("allreduce: a new float32 tensor with the sum; the input unchanged"):
    assert type(y) is torch.Tensor and y.dtype == torch.float32 and y.shape == x.shape, (y.dtype, y.shape)
    assert y.tolist() == [size * (size - 1) / 2 + size * 19, float(size * (size - 1))], y
    assert y.data_ptr() != x.data_ptr() and x.tolist() == [rank + 19, 2.0 * rank], x
with check("allreduce_ in place"):
    assert z.tolist() == [[size - 1.0] * 2] * 2 and z.dtype == torch.float64, z
with check("float16 and bfloat16 (the DLPack path) keep their dtypes"):
    assert h.dtype == torch.float16 and h.tolist() == [size * (size + 1) / 2] * 3, h
    assert bf.dtype == torch.bfloat16 and bf.tolist() == [size * (size + 1) / 2] * 3, bf
with check("bool"):
    assert flags.dtype == torch.bool and flags.tolist() == [True, False], flags
with check("allgather: a new tensor with every rank's rows in rank order"):
    assert type(g) is torch.Tensor and g.dtype == torch.int64 and g.tolist() == [[r, 19] for r in range(size)], g
    assert g16.dtype == torch.float16 and g16.tolist() == [r + 0.5 for r in range(size) for _ in range(2)], g16
with check("broadcast and broadcast_"):
    assert b.tolist() == [0, 1, 2, 3], b
    assert same is b_ and b_.tolist() == [size - 1] * 3, b_

# Gradients still flow through the synchronous allreduce, and a tensor that requires grad takes the careful
# path under no_grad too.
w = torch.ones(2, requires_grad=True)
out = hvd.allreduce(w * (rank + 1), op=hvd.Sum, name="t.grad")
out.sum().backward()
with check("allreduce is differentiable"):
    assert out.tolist() == [size * (size + 1) / 2] * 2 and w.grad.tolist() == [float(size * (rank + 1))] * 2
with torch.no_grad():
    no_grad = hvd.allreduce(w, op=hvd.Sum, name="t.nograd")
with check("a tensor that requires grad, under no_grad"):
    assert no_grad.tolist() == [float(size)] * 2, no_grad
hvd.shutdown()
finish(rank)
