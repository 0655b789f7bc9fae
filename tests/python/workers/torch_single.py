"""rvod.torch in a job of size 1 started with plain ``python`` (no rvodrun): ops before init, the DLPack
adapter (zero copy, copies only when needed), every op on one rank, DistributedOptimizer and SyncBatchNorm
reducing to plain PyTorch, compression, and init -> shutdown -> init.
"""

import re

import torch
from _check import check, finish
from torch import nn

import rvod.torch as hvd
from rvod.torch.adapter import TorchAdapter


def expect_error(error_type, pattern, call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except error_type as error:
        assert re.search(pattern, str(error)), f"{type(error).__name__} message {str(error)!r} !~ {pattern!r}"
        return
    except Exception as error:
        raise AssertionError(f"expected {error_type.__name__}, got {type(error).__name__}: {error}") from error
    raise AssertionError(f"expected {error_type.__name__} matching {pattern!r}, nothing was raised")


with check("before init: basics and ops raise ValueError naming init()"):
    assert hvd.is_initialized() is False
    for call in (hvd.size, hvd.rank, lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.broadcast_object(1),
                 lambda: hvd.allgather(torch.ones(2)), hvd.barrier):
        expect_error(ValueError, "init", call)

hvd.init()
x = torch.arange(12, dtype=torch.float32).reshape(4, 3)

with check("the adapter: zero copy for contiguous CPU tensors, a contiguous copy otherwise"):
    adapter = TorchAdapter()
    capsule, holder = adapter.export(x)
    assert holder is x
    assert torch.utils.dlpack.from_dlpack(capsule).data_ptr() == x.data_ptr()
    parameter = nn.Parameter(torch.ones(3))
    assert adapter.export(parameter)[1] is parameter, "a tensor that requires grad crosses without a copy"
    view = x.t()
    capsule, holder = adapter.export(view)
    assert holder is not view and holder.is_contiguous() and torch.equal(holder, view)
    negative = torch._neg_view(x)
    assert torch.equal(adapter.export(negative)[1], -x)
    assert adapter.received_splits([2, 1]).dtype == torch.int32

with check("size 1: every op returns its input's values, dtype and shape"):
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
        out = hvd.allreduce(x, op=op)
        assert out.dtype == x.dtype and torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), x / 2)
    y = x.clone()
    assert hvd.allreduce_(y) is y and torch.equal(y, x)
    assert [t.tolist() for t in hvd.grouped_allreduce([x, x[0]])] == [x.tolist(), x[0].tolist()]
    assert torch.equal(hvd.allgather(x), x) and torch.equal(hvd.broadcast(x, 0), x)
    assert torch.equal(hvd.alltoall(x), x)
    out, splits = hvd.alltoall(x, splits=[4])
    assert torch.equal(out, x) and splits.tolist() == [4] and splits.dtype == torch.int32
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    assert hvd.join() == 0
    hvd.barrier()
    assert hvd.broadcast_object({"k": (1, 2)}) == {"k": (1, 2)} and hvd.allgather_object("me") == ["me"]

with check("size 1: DistributedOptimizer trains exactly like the wrapped optimizer"):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    data = torch.randn(5, 8, 3)
    for batch in data:
        for net, optimizer in ((reference, ref_opt), (model, opt)):
            optimizer.zero_grad()
            net(batch).pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)

with check("size 1: SyncBatchNorm is BatchNorm"):
    torch.manual_seed(0)
    sync, plain = hvd.SyncBatchNorm(3), nn.BatchNorm2d(3)
    batch = torch.randn(4, 3, 2, 2)
    assert torch.equal(sync(batch), plain(batch))
    assert torch.equal(sync.running_var, plain.running_var)

with check("Compression: none, fp16, bf16 on float and integer tensors"):
    for compressor, wire in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        compressed, context = compressor.compress(torch.full((3,), 1.5, dtype=torch.float64))
        assert compressed.dtype == wire
        restored = compressor.decompress(compressed, context)
        assert restored.dtype == torch.float64 and torch.equal(restored, torch.full((3,), 1.5, dtype=torch.float64))
        ints = torch.arange(3)
        compressed, context = compressor.compress(ints)
        assert compressed is ints and compressor.decompress(compressed, context) is ints
    assert hvd.Compression.none.compress(x) == (x, None) and hvd.Compression.none.decompress(x, None) is x

hvd.shutdown()
with check("after shutdown ops raise; init again works"):
    expect_error(ValueError, "init", hvd.allreduce, torch.ones(2))
    hvd.init()
    assert hvd.size() == 1 and torch.equal(hvd.allreduce(x), x)
    hvd.shutdown()
finish(0)
