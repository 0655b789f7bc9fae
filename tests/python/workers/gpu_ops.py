"""CUDA tensors through rvod.torch, checked against the same ops on CPU tensors (tests/python/test_gpu.py).

Written for a machine with a GPU; never run on one yet (issue 20). Every rank uses GPU ``local_rank %
device_count``: with one GPU, a job of 2 ranks shares it (host staging), a job of 1 rank has it alone (NCCL).
With ``RVOD_TEST_GPU_OPS_DEVICE=cpu`` the same script runs on CPU tensors (less the stream-order case): a dry
run of the script's own logic, which test_gpu.py does where there is no GPU.
Sections: every op x dtype x variant; a stream-order case (a kernel writes the tensor on the current stream
just before the allreduce); DistributedOptimizer training equivalence (plain and sharded); SyncBatchNorm
against BatchNorm on the concatenated batch.
"""

import os

import torch
from _check import check, finish

import rvod.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
ON_GPU = os.environ.get("RVOD_TEST_GPU_OPS_DEVICE", "cuda") == "cuda"
if ON_GPU:
    DEVICE = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
else:
    DEVICE = torch.device("cpu")
torch.manual_seed(1234 + R)

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.int8)
REDUCE_OPS = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)


def values(shape, dtype, salt):
    """Rank-dependent values every dtype holds exactly (small integers)."""
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)
    return ((base + salt + R) % 5 + 1).to(dtype)


def same(gpu_result, cpu_result, label):
    assert gpu_result.device.type == DEVICE.type, f"{label}: result on {gpu_result.device}"
    assert gpu_result.dtype == cpu_result.dtype and gpu_result.shape == cpu_result.shape, label
    torch.testing.assert_close(gpu_result.cpu(), cpu_result, rtol=1e-2, atol=1e-2, msg=label)


for dtype in DTYPES:
    for op in REDUCE_OPS:
        if op == hvd.Average and not dtype.is_floating_point:
            continue
        for variant in ("sync", "async", "in_place"):
            label = f"allreduce {dtype} op={op} {variant}"
            with check(label):
                cpu = values((3, 5), dtype, 1)
                gpu = cpu.to(DEVICE)
                name = f"ar.{dtype}.{op}.{variant}"
                want = hvd.allreduce(cpu, op=op, name=name + ".cpu")
                if variant == "sync":
                    got = hvd.allreduce(gpu, op=op, name=name)
                elif variant == "async":
                    got = hvd.synchronize(hvd.allreduce_async(gpu, op=op, name=name))
                else:
                    got = hvd.allreduce_(gpu, op=op, name=name)
                    assert got is gpu
                same(got, want, label)
    if dtype.is_floating_point:
        with check(f"allreduce {dtype} with pre/postscale"):
            cpu = values((7,), dtype, 2)
            want = hvd.allreduce(cpu, op=hvd.Sum, prescale_factor=0.5, postscale_factor=2.0, name=f"sc.{dtype}.cpu")
            got = hvd.allreduce(cpu.to(DEVICE), op=hvd.Sum, prescale_factor=0.5, postscale_factor=2.0, name=f"sc.{dtype}")
            same(got, want, "scaled")
    with check(f"grouped_allreduce {dtype}"):
        cpus = [values((4,), dtype, 3), values((2, 3), dtype, 4)]
        wants = hvd.grouped_allreduce(cpus, op=hvd.Sum, name=f"g.{dtype}.cpu")
        gots = hvd.grouped_allreduce([t.to(DEVICE) for t in cpus], op=hvd.Sum, name=f"g.{dtype}")
        for got, want in zip(gots, wants):
            same(got, want, "grouped")
    with check(f"allgather {dtype} with uneven first dimensions"):
        cpu = values((R + 1, 3), dtype, 5)
        same(hvd.allgather(cpu.to(DEVICE), name=f"ag.{dtype}"), hvd.allgather(cpu, name=f"ag.{dtype}.cpu"), "allgather")
    with check(f"broadcast {dtype} and broadcast_"):
        cpu = values((5,), dtype, 6)
        same(hvd.broadcast(cpu.to(DEVICE), 0, name=f"bc.{dtype}"), hvd.broadcast(cpu, 0, name=f"bc.{dtype}.cpu"), "bc")
        gpu = cpu.to(DEVICE)
        hvd.broadcast_(gpu, 0, name=f"bc_.{dtype}")
        same(gpu, hvd.broadcast(cpu, 0, name=f"bc_.{dtype}.cpu"), "broadcast_")
    with check(f"alltoall {dtype} with splits"):
        splits = torch.tensor([(R + i) % 2 + 1 for i in range(N)], dtype=torch.int32)
        cpu = values((int(splits.sum()), 2), dtype, 7)
        want, want_splits = hvd.alltoall(cpu, splits=splits, name=f"a2a.{dtype}.cpu")
        got, got_splits = hvd.alltoall(cpu.to(DEVICE), splits=splits, name=f"a2a.{dtype}")
        same(got, want, "alltoall")
        assert got_splits.tolist() == want_splits.tolist()
    if dtype.is_floating_point or dtype in (torch.int32, torch.int64):
        with check(f"reducescatter {dtype}"):
            cpu = values((2 * N, 3), dtype, 8)
            want = hvd.reducescatter(cpu, op=hvd.Sum, name=f"rs.{dtype}.cpu")
            same(hvd.reducescatter(cpu.to(DEVICE), op=hvd.Sum, name=f"rs.{dtype}"), want, "reducescatter")

with check("stream order: a kernel writes the tensor on the current stream just before the allreduce"):
    for i in range(20 if ON_GPU else 0):
        x = torch.zeros(1 << 20, device=DEVICE)
        torch.cuda._sleep(1_000_000)  # keep the stream busy so a read that does not wait sees zeros
        x.add_(R + 1.0)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"order.{i}")
        got.mul_(1.0)  # the framework's stream uses the result right away
        assert torch.all(got == N * (N + 1) / 2).item(), f"round {i}: {got[:4]}"

for sharded in (False, True):
    with check(f"DistributedOptimizer(sharded={sharded}) on GPU trains as one process on the whole batch"):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(DEVICE)
        reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(DEVICE)
        reference.load_state_dict(model.state_dict())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Sharded: each rank keeps the momentum of its own slice (ZeRO), reduce-scattered and allgathered on GPU.
        momentum = 0.9 if sharded else 0.0
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                             named_parameters=model.named_parameters(), sharded=sharded)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum)
        generator = torch.Generator().manual_seed(99)
        for step in range(5):
            batch = torch.randn(4 * N, 8, generator=generator).to(DEVICE)
            target = torch.randn(4 * N, 1, generator=generator).to(DEVICE)
            mine = slice(4 * R, 4 * R + 4)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(batch[mine]), target[mine]).backward()
            optimizer.step()
            reference_optimizer.zero_grad()
            torch.nn.functional.mse_loss(reference(batch), target).backward()
            reference_optimizer.step()
        if sharded:
            optimizer.wait_for_parameters()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.device == DEVICE, f"{name} moved to {p.device}"
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)

with check("SyncBatchNorm on GPU equals BatchNorm on the concatenated batch"):
    generator = torch.Generator().manual_seed(5)
    full = torch.randn(3 * N, 4, 5, generator=generator).to(DEVICE).requires_grad_()
    weights = torch.randn(3 * N, 4, 5, generator=generator).to(DEVICE)  # a loss whose input gradient is not ~0
    sync_bn = hvd.SyncBatchNorm(4).to(DEVICE)
    bn = torch.nn.BatchNorm1d(4).to(DEVICE)
    mine = full[3 * R:3 * R + 3].detach().clone().requires_grad_()
    out = sync_bn(mine)
    expected = bn(full)
    torch.testing.assert_close(out, expected[3 * R:3 * R + 3], rtol=1e-4, atol=1e-5)
    (out * weights[3 * R:3 * R + 3]).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(mine.grad, full.grad[3 * R:3 * R + 3], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sync_bn.running_mean, bn.running_mean, rtol=1e-4, atol=1e-5)

hvd.shutdown()
finish(R)
