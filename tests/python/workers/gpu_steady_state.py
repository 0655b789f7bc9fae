"""Rank script: many allreduces in a row on stand-in GPU tensors (tests/python/test_gpu_device_path.py): every result
right and on its tensor's GPU, and rvod's host work per op in steady state as the stand-in counts calls: no new CUDA
event per op (each GPU's events are pooled), no device discovery per tensor (cudaGetDeviceCount), no new stream,
and no cudaSetDevice where the thread is on the tensor's GPU already.

Two phases of OPS ops, after a warm-up: "kept" (every result kept until the end: nothing goes back to rvod's buffer
pool, and only rvod's calls fall in the counted window), then "freed" (each result read and freed at once: the next
op reuses its buffer, after the event that guards its readers). Prints "case NAME ok" or "case NAME WRONG ...",
and "calls PHASE {name: calls}" for the record.

Settings: GPU_OF_RANK ("same": every rank on GPU 0; "own": rank r on GPU r; "both": every rank alternates between
GPUs 0 and 1, op by op, as host staging allows); the stand-in's RVOD_STANDIN_*.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.environ["STANDIN_DIR"])
import gpu_standin as g  # noqa: E402

import rvod.numpy as hvd  # noqa: E402
from rvod import _rvod  # noqa: E402
from rvod.common.ops import ALLREDUCE  # noqa: E402
from rvod.common.reduce_ops import Sum  # noqa: E402

OPS = 100
N = 1000
COUNTED = ("cudaEventCreateWithFlags", "cudaGetDeviceCount", "cudaStreamCreateWithFlags", "cudaSetDevice")
# New events a phase may create: the pool fills up to what is in flight at once (a few per op), not one per op.
EVENT_BOUND = 10

hvd.init()
rank, size = hvd.rank(), hvd.size()
placement = os.environ.get("GPU_OF_RANK", "same")
gpus = [0, 1] if placement == "both" else [0] if placement == "same" else [rank]
# The framework's current stream on each GPU (non-blocking, as torch's side streams).
framework = {gpu: g.new_stream(gpu) for gpu in gpus}


def check(name, good, detail=""):
    print(f"case {name} {'ok' if good else f'WRONG {detail}'}", flush=True)


def inputs(count):
    """One device array per op, op i's on GPU gpus[i % len(gpus)] holding (rank + 1) * (i + 1) once a framework kernel
    on its GPU's stream has written it (late, with the stand-in's stream delay): rvod must wait for that kernel."""
    arrays = []
    for i in range(count):
        gpu = gpus[i % len(gpus)]
        array = g.DeviceArray(np.zeros(N, np.float32), device=gpu, stream=framework[gpu])
        array.write_async(np.full(N, (rank + 1) * (i + 1), np.float32))
        arrays.append(array)
    return arrays


def allreduce(name, array, consumer):
    """An out-of-place allreduce of ``array``, its ready event recorded on the framework's stream; its result made
    ready on ``consumer`` (None: the host waits for it)."""
    capsule = array.__dlpack__(stream=-1)
    handle = _rvod.submit(ALLREDUCE, [name], [capsule], False, Sum, 1.0, 1.0, -1, 0, False, False, [],
                          framework[array.device])
    (result,), _, _ = _rvod.wait(handle, consumer)
    return result


def wrong_result(i, gpu, result):
    """Why op i's result (a CUDA capsule) is wrong, or None."""
    device, values = g.read_capsule(result)
    expected = (i + 1) * size * (size + 1) // 2
    if device != gpu or values.shape != (N,) or not np.all(values == expected):
        return f"op {i}: GPU {device} (expected {gpu}), values {values[:3].tolist()} (expected {expected})"
    return None


def phase(name, arrays, keep):
    """Run the ops; returns (wrong results, calls counted during the ops, result addresses)."""
    kept, wrong, addresses = [], [], []
    before = g.calls(*COUNTED)
    for i, array in enumerate(arrays):
        consumer = framework[array.device] if i % 2 else None
        result = allreduce(f"steady.{name}.{i}", array, consumer)
        addresses.append((array.device, g.capsule_tensor(result).data))
        if keep:
            kept.append((i, array.device, result))
        else:
            wrong.append(wrong_result(i, array.device, result))
            del result  # back to rvod's pool, guarded by an event on `consumer`: the next op reuses it
    after = g.calls(*COUNTED)
    wrong += [wrong_result(i, gpu, result) for i, gpu, result in kept]
    counted = {call: after[call] - before[call] for call in COUNTED}
    print(f"calls {name} {counted}", flush=True)
    return [w for w in wrong if w], counted, addresses


# Warm-up: the route agreed, contexts, streams and communicators made, the pools filled.
for i, array in enumerate(inputs(4 * len(gpus))):
    wrong = wrong_result(i, array.device, allreduce(f"steady.warm-up.{i}", array,
                                                    framework[array.device] if i % 2 else None))
    if wrong:
        check("warm-up", False, wrong)

kept_inputs, freed_inputs = inputs(OPS), inputs(OPS)
wrong_kept, kept, _ = phase("kept", kept_inputs, keep=True)
wrong_freed, freed, addresses = phase("freed", freed_inputs, keep=False)

check("values.kept", not wrong_kept, wrong_kept[:3])
check("values.freed", not wrong_freed, wrong_freed[:3])
check("events.kept", kept["cudaEventCreateWithFlags"] < EVENT_BOUND, kept)
check("events.freed", freed["cudaEventCreateWithFlags"] < EVENT_BOUND, freed)
check("discovery", kept["cudaGetDeviceCount"] == freed["cudaGetDeviceCount"] == 0, (kept, freed))
check("streams", kept["cudaStreamCreateWithFlags"] == freed["cudaStreamCreateWithFlags"] == 0, (kept, freed))
# A freed result's buffer is reused by the next op of its size on its GPU (a second one at most while the
# first's readers are being marked).
distinct = {gpu: len({address for on, address in addresses if on == gpu}) for gpu in gpus}
check("buffers.reused", all(n <= 2 for n in distinct.values()), distinct)
if gpus == [0]:
    # Every thread that runs rvod's calls (this one, the engine's) is on GPU 0 already: no cudaSetDevice at all.
    check("set_device.kept", kept["cudaSetDevice"] == 0, kept)
if placement == "both":
    streams = [_rvod.device_stream(gpu) for gpu in gpus]
    check("device_streams", len(set(streams)) == 2 and streams == [_rvod.device_stream(gpu) for gpu in gpus],
          streams)

hvd.shutdown()
