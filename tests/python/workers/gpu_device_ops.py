"""Rank script: every op on stand-in GPU tensors (DeviceArray, tests/python/gpu_standin.py) through rvod's
native entry, each against the same op on host arrays through rvod.numpy. Prints one line per case
("case NAME ok" or "case NAME WRONG ...") and "cases done N".

Settings: GPU_OF_RANK ("same": every rank on GPU 0; "own": rank r on GPU r); the stand-in's RVOD_STANDIN_*.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.environ["STANDIN_DIR"])
import gpu_standin as g  # noqa: E402

import rvod.numpy as hvd  # noqa: E402
from rvod import _rvod  # noqa: E402
from rvod.common import ops  # noqa: E402
from rvod.common.reduce_ops import Adasum, Average, Max, Min, Product, Sum  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
device = 0 if os.environ.get("GPU_OF_RANK", "same") == "same" else rank
rvod_stream = _rvod.device_stream(device)
framework = g.new_stream(device)
count = 0


def values(shape, dtype, seed):
    rng = np.random.default_rng(seed * 7919 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.uniform(-2, 2, shape).astype(dtype)
    return rng.integers(1, 4, shape).astype(dtype)


def on_device(host):
    """A DeviceArray holding 0xff garbage until a framework kernel on `framework` writes `host` into it (run
    late when a stream delay is set): rvod must wait for that kernel."""
    array = g.DeviceArray(np.zeros_like(host), device=device, stream=framework)
    array.write_async(host)
    return array


def submit(kind, names, arrays, *, in_place=False, op=Sum, prescale=1.0, postscale=1.0, root=-1, splits=(),
           set_id=0, via_framework_stream=True):
    """Submit on device arrays: with the framework's stream (its ready event recorded there), or by DLPack's
    stream handshake with rvod's stream."""
    if via_framework_stream:
        capsules = [a.__dlpack__(stream=-1) for a in arrays]
        stream = framework
    else:
        capsules = [a.__dlpack__(stream=rvod_stream) for a in arrays]
        stream = None
    handle = _rvod.submit(kind, names, capsules, in_place, op, prescale, postscale, root, set_id, False, False,
                          list(splits), stream)
    return handle, capsules


def results(handle, capsules, arrays, in_place):
    outputs, received, _ = _rvod.wait(handle)
    del capsules
    if in_place:
        return [a.to_numpy() for a in arrays], received
    read = []
    for capsule in outputs:
        dev, got = g.read_capsule(capsule)
        assert dev == device, (dev, device)
        read.append(got)
    return read, received


def check(name, got, expected, exact):
    global count
    count += 1
    got, expected = np.asarray(got), np.asarray(expected)
    same = got.shape == expected.shape and (
        np.array_equal(got, expected) if exact else np.allclose(got, expected, rtol=1e-3, atol=1e-3))
    print(f"case {name} {'ok' if same else f'WRONG got {got.ravel()[:6]} expected {expected.ravel()[:6]}'}",
          flush=True)


dtypes = [np.float32, np.float64, np.int32, np.float16]
n = 0
for dtype in dtypes:
    for op in (Sum, Average, Min, Max, Product):
        if op == Average and np.dtype(dtype).kind != "f":
            continue
        for in_place in (False, True):
            for pre, post in ((1.0, 1.0), (0.5, 3.0)) if op in (Sum, Average) else ((1.0, 1.0),):
                n += 1
                host = values((3, 5), dtype, n)
                expected = hvd.allreduce(host, op=op, prescale_factor=pre, postscale_factor=post,
                                         name=f"ref.ar.{n}")
                arrays = [on_device(host)]
                handle, caps = submit(ops.ALLREDUCE, [f"allreduce.dev.{n}"], arrays, in_place=in_place, op=op,
                                      prescale=pre, postscale=post, via_framework_stream=n % 2 == 0)
                got, _ = results(handle, caps, arrays, in_place)
                check(f"allreduce.{np.dtype(dtype).name}.{op}.{in_place}.{pre}", got[0], expected,
                      np.dtype(dtype).kind != "f" or dtype == np.float16 and False)

# int16: NCCL has no such type, so it stages on every route.
host = values((6,), np.int16, 90)
expected = hvd.allreduce(host, op=Sum, name="ref.ar.int16")
arrays = [on_device(host)]
handle, caps = submit(ops.ALLREDUCE, ["allreduce.dev.int16"], arrays, op=Sum)
check("allreduce.int16", results(handle, caps, arrays, False)[0][0], expected, True)

# A fused response: several tensors of one op, of two dtypes, and a grouped allreduce.
hosts = [values((4,), np.float32, 100), values((2, 3), np.float32, 101), values((7,), np.float64, 102)]
expected = [hvd.allreduce(h, op=Sum, name=f"ref.fused.{i}") for i, h in enumerate(hosts)]
arrays = [on_device(h) for h in hosts]
handle, caps = submit(ops.ALLREDUCE, [f"allreduce.fused.{i}" for i in range(3)], arrays)
got, _ = results(handle, caps, arrays, False)
for i in range(3):
    check(f"fused.{i}", got[i], expected[i], False)
expected = hvd.grouped_allreduce(hosts, op=Average, name="ref.grouped")
arrays = [on_device(h) for h in hosts]
caps = [a.__dlpack__(stream=-1) for a in arrays]
handle = _rvod.submit(ops.ALLREDUCE, ["grouped_allreduce.dev"], caps, True, Average, 1.0, 1.0, -1, 0, False, True,
                      [], framework)
_rvod.wait(handle)
for i, a in enumerate(arrays):
    check(f"grouped.{i}", a.to_numpy(), expected[i], False)

# Adasum (staged on every route), float32.
host = values((6,), np.float32, 200)
expected = hvd.allreduce(host, op=Adasum, name="ref.adasum")
arrays = [on_device(host)]
handle, caps = submit(ops.ALLREDUCE, ["allreduce.adasum"], arrays, op=Adasum)
check("adasum", results(handle, caps, arrays, False)[0][0], expected, False)

for dtype in (np.float32, np.int64, np.uint8):
    name = np.dtype(dtype).name
    # Allgather with uneven first dimensions.
    host = values((rank + 1, 3), dtype, 300)
    expected = hvd.allgather(host, name=f"ref.ag.{name}")
    arrays = [on_device(host)]
    handle, caps = submit(ops.ALLGATHER, [f"allgather.dev.{name}"], arrays)
    check(f"allgather.{name}", results(handle, caps, arrays, False)[0][0], expected, True)
    # Broadcast, out of place and in place.
    for in_place in (False, True):
        host = values((5,), dtype, 400 + in_place)
        root = size - 1
        expected = hvd.broadcast(host, root_rank=root, name=f"ref.bc.{name}.{in_place}")
        arrays = [on_device(host)]
        handle, caps = submit(ops.BROADCAST, [f"broadcast.dev.{name}.{in_place}"], arrays, in_place=in_place,
                              root=root)
        check(f"broadcast.{name}.{in_place}", results(handle, caps, arrays, in_place)[0][0], expected, True)
    # Alltoall with splits.
    splits = [(rank + r) % 2 + 1 for r in range(size)]
    host = values((sum(splits), 2), dtype, 500)
    expected, expected_splits = hvd.alltoall(host, splits=splits, name=f"ref.a2a.{name}")
    arrays = [on_device(host)]
    handle, caps = submit(ops.ALLTOALL, [f"alltoall.dev.{name}"], arrays, splits=splits)
    got, received = results(handle, caps, arrays, False)
    check(f"alltoall.{name}", got[0], expected, True)
    check(f"alltoall.{name}.splits", received, list(expected_splits), True)
    # Reducescatter: uneven rows (the first ranks get one more; host staging on every route) and even ones
    # (NCCL's ncclReduceScatter where each rank has a GPU of its own).
    for rows, op in ((size * 2 + 1, Sum), (size * 2, Sum), (size * 2, Average)):
        if op == Average and np.dtype(dtype).kind != "f":
            continue
        host = values((rows, 3), dtype, 600 + rows)
        expected = hvd.reducescatter(host, op=op, name=f"ref.rs.{name}.{rows}.{op}")
        arrays = [on_device(host)]
        handle, caps = submit(ops.REDUCESCATTER, [f"reducescatter.dev.{name}.{rows}.{op}"], arrays, op=op)
        check(f"reducescatter.{name}.{rows}.{op}", results(handle, caps, arrays, False)[0][0], expected,
              np.dtype(dtype).kind != "f")

# Async: many in flight at once, waited for in reverse.
hosts = [values((8,), np.float32, 700 + i) for i in range(6)]
expected = [hvd.allreduce(h, op=Sum, name=f"ref.async.{i}") for i, h in enumerate(hosts)]
pending = []
for i, h in enumerate(hosts):
    arrays = [on_device(h)]
    pending.append((i, arrays, *submit(ops.ALLREDUCE, [f"allreduce.async.{i}"], arrays)))
for i, arrays, handle, caps in reversed(pending):
    check(f"async.{i}", results(handle, caps, arrays, False)[0][0], expected[i], False)

# A process set of the ranks but the last (where there are 3 or more).
if size >= 3:
    members = list(range(size - 1))
    subset = hvd.add_process_set(members)
    if rank in members:
        host = values((4,), np.float32, 800)
        expected = hvd.allreduce(host, op=Sum, name="ref.set", process_set=subset)
        arrays = [on_device(host)]
        handle, caps = submit(ops.ALLREDUCE, ["allreduce.set"], arrays, set_id=subset.process_set_id)
        check("process_set", results(handle, caps, arrays, False)[0][0], expected, False)
    hvd.barrier()

hvd.barrier()
print(f"cases done {count}", flush=True)
hvd.shutdown()
