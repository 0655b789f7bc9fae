"""The GPU stand-in (tests/gpu_standin/) and its DeviceArray: that it behaves as a GPU where rvod could go wrong,
and that rvod, loading it as its CUDA and NCCL, sees a usable GPU and refuses CUDA tensors with its reason.

Every check that runs the library's workers or NCCL runs in ``python -c`` subprocesses (settings are read once
per process; a rank that dies must be a process). Skipped, with the reason, where no C compiler is found.
About 15 s.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_standin

LIBRARY = gpu_standin.library_or_skip()

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(120)

# Rank scripts: ctypes over the stand-in's NCCL, one process per rank.
PRELUDE = f"""
import ctypes, os, sys, time
import numpy as np
sys.path.insert(0, {str(HERE)!r})
import gpu_standin as g
lib = g.load()
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
P, I, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
lib.ncclCommInitRank.argtypes = [ctypes.POINTER(P), I, UniqueId, I]
for name in ("ncclAllReduce", "ncclReduceScatter"):
    getattr(lib, name).argtypes = [P, P, S, I, I, P, P]
lib.ncclBroadcast.argtypes = [P, P, S, I, I, P, P]
lib.ncclAllGather.argtypes = [P, P, S, I, P, P]
lib.ncclGetLastError.argtypes, lib.ncclGetLastError.restype = [P], ctypes.c_char_p
lib.ncclGetErrorString.restype = ctypes.c_char_p
lib.ncclCommGetAsyncError.argtypes = [P, ctypes.POINTER(I)]
lib.ncclCommAbort.argtypes = lib.ncclCommDestroy.argtypes = [P]
rank, size, device = int(os.environ["RANK"]), int(os.environ["SIZE"]), int(os.environ.get("DEVICE", os.environ["RANK"]))
uid = UniqueId.from_buffer_copy(bytes.fromhex(os.environ["ID"]))
g.check(lib.cudaSetDevice(device))
comm = P()
status = lib.ncclCommInitRank(ctypes.byref(comm), size, uid, rank)
def nccl_error(status):
    return f"{{lib.ncclGetErrorString(status).decode()}} ({{status}}) - {{lib.ncclGetLastError(comm).decode()}}"
"""


def unique_id_hex() -> str:
    lib = gpu_standin.load()
    uid = ctypes.create_string_buffer(128)
    assert lib.ncclGetUniqueId(uid) == 0
    return uid.raw.hex()


def run_ranks(body: str, size: int, timeout: float = 60, per_rank: dict[int, dict[str, str]] | None = None,
              **settings) -> list[subprocess.CompletedProcess[str]]:
    """Start `size` rank processes running PRELUDE + body; their results, in rank order."""
    common = {**os.environ, **gpu_standin.env(**settings), "ID": unique_id_hex(), "SIZE": str(size)}
    processes = [subprocess.Popen([sys.executable, "-c", PRELUDE + body],
                                  env={**common, "RANK": str(r), **(per_rank or {}).get(r, {})},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(size)]
    results = []
    for p in processes:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            outputs = [q.communicate() for q in processes]
            pytest.fail(f"a rank did not finish within {timeout} s; their output: {outputs}")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def python(code: str, **settings) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r})\n" + code],
                          env={**os.environ, **gpu_standin.env(**settings)}, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(autouse=True)
def no_shared_memory_left():
    yield
    left = [name for name in os.listdir("/dev/shm") if name.startswith("rvod-standin-")]
    assert not left, f"shared-memory segments left behind: {left}"


def test_device_memory_is_not_host_memory():
    code = """
import ctypes, numpy as np, gpu_standin as g
a = g.DeviceArray(np.arange(4, dtype=np.float32), device=1)
print(a.to_numpy().tolist(), g.load().standin_device_of(ctypes.c_void_p(a.ptr)), flush=True)
ctypes.string_at(a.ptr, 4)  # what a host read of a CUDA pointer does
print("read")
"""
    result = python(code)
    assert result.stdout.splitlines() == ["[0.0, 1.0, 2.0, 3.0] 1"], result.stderr
    assert result.returncode == -11, "a host read of device memory is a segmentation fault, as on a GPU"


def test_a_kernel_on_another_stream_is_seen_only_after_waiting_for_it():
    code = """
import ctypes, numpy as np, gpu_standin as g
lib = g.load()
a = g.DeviceArray(np.zeros(3, np.float32), device=1)
framework = g.new_stream(1)
a.write_async([1, 2, 3], stream=framework)
print("peek", a.peek().tolist())
print("legacy stream, no wait", a.to_numpy(stream=0).tolist())
print("framework stream", a.to_numpy(stream=framework).tolist())
# An event recorded before the kernel does not cover it; re-recording it later does not change a wait made before.
other = g.new_stream(1)
event = ctypes.c_void_p(); g.check(lib.cudaEventCreateWithFlags(ctypes.byref(event), 2))
g.check(lib.cudaEventRecord(event, framework))
a.write_async([4, 5, 6], stream=framework)
g.check(lib.cudaStreamWaitEvent(other, event, 0))
g.check(lib.cudaEventRecord(event, framework))
print("query", lib.cudaEventQuery(event))
print("waited on the earlier record", a.to_numpy(stream=other).tolist())
g.check(lib.cudaStreamWaitEvent(other, event, 0))
print("waited on the later record", a.to_numpy(stream=other).tolist())
fresh = ctypes.c_void_p(); g.check(lib.cudaEventCreateWithFlags(ctypes.byref(fresh), 2))
print("never recorded", lib.cudaEventQuery(fresh))
"""
    result = python(code, stream_delay_us=2000, kernel_us=50000)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "peek [0.0, 0.0, 0.0]",
        "legacy stream, no wait [0.0, 0.0, 0.0]",  # the non-blocking stream's kernel has not run
        "framework stream [1.0, 2.0, 3.0]",
        "query 600",  # cudaErrorNotReady
        "waited on the earlier record [1.0, 2.0, 3.0]",
        "waited on the later record [4.0, 5.0, 6.0]",
        "never recorded 0",
    ]


def test_calls_are_counted_by_name():
    """standin_calls, which the per-op cost tests read (tests/python/workers/gpu_steady_state.py): a call that fails
    counts too; a name never called, or no function's, is 0."""
    code = """
import ctypes, gpu_standin as g
lib = g.load()
names = ("cudaSetDevice", "cudaEventCreateWithFlags", "cudaMalloc", "cudaNoSuchCall")
before = g.calls(*names)
g.check(lib.cudaSetDevice(1))
g.check(lib.cudaSetDevice(0))
print("invalid device:", lib.cudaSetDevice(9))
event = ctypes.c_void_p()
g.check(lib.cudaEventCreateWithFlags(ctypes.byref(event), 2))
after = g.calls(*names)
print({name: after[name] - before[name] for name in names})
"""
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "invalid device: 101",
        "{'cudaSetDevice': 3, 'cudaEventCreateWithFlags': 1, 'cudaMalloc': 0, 'cudaNoSuchCall': 0}",
    ]


def test_dlpack_capsule_fields_stream_protocol_and_deleter():
    code = """
import ctypes, gc, numpy as np, gpu_standin as g
a = g.DeviceArray(np.arange(6, dtype=np.float16).reshape(2, 3), device=1)
framework = g.new_stream(1)
a.write_async(np.full((2, 3), 7, np.float16), stream=framework)
print(a.__dlpack_device__())
capsule = a.__dlpack__(stream=1)  # the consumer uses the legacy stream: the producer makes it wait
get = ctypes.pythonapi.PyCapsule_GetPointer
get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
m = g.DLManagedTensor.from_address(get(capsule, b"dltensor"))
t = m.dl_tensor
print(t.data == a.ptr, (t.device.device_type, t.device.device_id), t.ndim, [t.shape[i] for i in range(t.ndim)],
      bool(t.strides), (t.dtype.code, t.dtype.bits, t.dtype.lanes), t.byte_offset, m.deleter is not None)
print("legacy stream after __dlpack__", a.to_numpy(stream=0).ravel().tolist())
print("exported", g.exported_capsules())
del capsule, m, t
gc.collect()
print("exported after the capsule is gone", g.exported_capsules())
try:
    a.__dlpack__(stream=0)
except ValueError as error:
    print("stream 0:", error)
"""
    result = python(code, stream_delay_us=2000, kernel_us=50000)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "(2, 1)",
        "True (2, 1) 2 [2, 3] False (2, 16, 1) 0 True",
        "legacy stream after __dlpack__ [7.0, 7.0, 7.0, 7.0, 7.0, 7.0]",
        "exported 1",
        "exported after the capsule is gone 0",
        "stream 0: stream 0 is ambiguous for CUDA in the DLPack protocol: pass 1 (legacy) or 2 (per-thread)",
    ]


def test_out_of_memory_and_injected_cuda_errors():
    code = """
import numpy as np, gpu_standin as g
for shape in ((1 << 20,), (4,)):
    try:
        g.DeviceArray(np.zeros(shape, np.float32))
    except g.CudaError as error:
        print(error)
"""
    result = python(code, device_memory="1M", fail="cudaMalloc:2:400")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["cudaErrorMemoryAllocation: out of memory",
                                          "cudaErrorInvalidResourceHandle: invalid resource handle"]


ALLREDUCE = """
assert status == 0, nccl_error(status)
stream = g.new_stream(device)
values = np.arange(5000, dtype=np.float32) % 7 + rank
out = {}
for name, dtype, code in (("float32", np.float32, 7), ("float16", np.float16, 6), ("int64", np.int64, 4)):
    a = g.DeviceArray(values.astype(dtype), device=device)
    assert lib.ncclAllReduce(a.ptr, a.ptr, 5000, code, 0, comm, stream) == 0
    out[name] = a.to_numpy(stream=stream)
b = g.DeviceArray(np.full(3, rank, np.float64), device=device)
assert lib.ncclBroadcast(b.ptr, b.ptr, 3, 8, 2, comm, stream) == 0
gathered = g.DeviceArray(np.zeros(size * 2, np.int32), device=device)
mine = g.DeviceArray(np.full(2, rank, np.int32), device=device)
assert lib.ncclAllGather(mine.ptr, gathered.ptr, 2, 2, comm, stream) == 0
expected = sum(np.arange(5000, dtype=np.float64) % 7 + r for r in range(size))
print(all(np.array_equal(out[k].astype(np.float64), expected) for k in out), b.to_numpy(stream=stream).tolist(),
      gathered.to_numpy(stream=stream).tolist())
assert lib.ncclCommDestroy(comm) == 0
print("live", lib.standin_live(b"comms"), lib.standin_live(b"streams"))
"""


def test_nccl_across_three_processes():
    results = run_ranks(ALLREDUCE, 3, devices=3, nccl_slot_bytes=4096, stream_delay_us=500)
    for rank, result in enumerate(results):
        assert result.returncode == 0, (rank, result.stderr)
        assert result.stdout.splitlines() == ["True [2.0, 2.0, 2.0] [0, 0, 1, 1, 2, 2]", "live 0 1"], rank


def test_two_processes_on_one_gpu_are_refused_as_nccl_does():
    body = "print(status, nccl_error(status))\n"
    # Both see physical GPU 1 as their device 0 (CUDA_VISIBLE_DEVICES), as ranks sharing one GPU do.
    results = run_ranks(body, 2, per_rank={0: {"CUDA_VISIBLE_DEVICES": "1", "DEVICE": "0"},
                                           1: {"CUDA_VISIBLE_DEVICES": "1,0", "DEVICE": "0"}})
    for result in results:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (
            "5 invalid usage (run with NCCL_DEBUG=WARN for details) (5) - Duplicate GPU detected : rank 0 and rank 1 "
            "both on CUDA device 0 (bus id 00000000:11:00.0)")


def test_a_rank_that_dies_fails_the_others_instead_of_hanging():
    body = """
assert status == 0, nccl_error(status)
if rank == 1:
    os._exit(3)
stream = g.new_stream(device)
a = g.DeviceArray(np.ones(8, np.float32), device=device)
assert lib.ncclAllReduce(a.ptr, a.ptr, 8, 7, 0, comm, stream) == 0
started, error = time.time(), I(0)
while error.value == 0 and time.time() - started < 30:
    assert lib.ncclCommGetAsyncError(comm, ctypes.byref(error)) == 0
    time.sleep(0.01)
print(error.value, lib.ncclGetLastError(comm).decode())
print("stream still busy:", lib.cudaStreamQuery(ctypes.c_void_p(stream)))
assert lib.ncclCommAbort(comm) == 0
g.check(lib.cudaStreamSynchronize(stream))
print("after abort: stream done in", "under 10 s" if time.time() - started < 10 else "too long")
"""
    survivor, dead = run_ranks(body, 2)
    assert dead.returncode == 3
    assert survivor.returncode == 0, survivor.stderr
    lines = survivor.stdout.splitlines()
    assert re.fullmatch(r"6 rank 1 \(pid \d+, GPU 1\) exited while rank 0 \(GPU 0\) waited for it in ncclAllReduce",
                        lines[0]), lines
    assert lines[1:] == ["stream still busy: 600", "after abort: stream done in under 10 s"]


def test_an_injected_nccl_error_carries_its_text():
    body = """
assert status == 0, nccl_error(status)
stream = g.new_stream(device)
a = g.DeviceArray(np.ones(8, np.float32), device=device)
status = lib.ncclAllReduce(a.ptr, a.ptr, 8, 7, 0, comm, stream)
print(status, nccl_error(status))
lib.ncclCommAbort(comm)
"""
    results = run_ranks(body, 1, fail="ncclAllReduce:1:6:NET/IB : peer 10.0.0.2 went away")
    assert results[0].stdout.strip() == ("6 remote process exited or there was a network error (6) - "
                                         "NET/IB : peer 10.0.0.2 went away"), results[0].stderr


def test_rvod_sees_the_standin_as_a_usable_gpu_and_runs_collectives_on_its_tensors():
    code = """
import ctypes, gc, numpy as np, gpu_standin as g
import rvod.numpy as hvd
from rvod import _rvod
info = _rvod.gpu_libraries()
print(info["device_count"], info["nccl_version_text"], info["cuda_path"] == info["nccl_path"] == str(g.library_path()),
      info["gpu_collectives"], info["unavailable"])
hvd.init()
array = g.DeviceArray(np.arange(3, dtype=np.float32), device=1)
g.check(g.load().cudaSetDevice(0))
result = hvd.allreduce(array, name="grads.w", postscale_factor=2.0)
current = ctypes.c_int(-1)
g.check(g.load().cudaGetDevice(ctypes.byref(current)))
print("current device:", current.value)
print(type(result).__name__, g.read_capsule(result.__dlpack__()))
hvd.allreduce_(array, name="grads.w", prescale_factor=3.0)
print("in place:", array.to_numpy().tolist())
del result
gc.collect()
print("capsules not yet deleted:", g.exported_capsules())
print("after:", hvd.allreduce(np.ones(3, np.float32), name="cpu").tolist())
hvd.shutdown()
"""
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "2 2.21.5 True True None",
        "current device: 0",
        "DeviceResult (1, array([0., 2., 4.], dtype=float32))",
        "in place: [0.0, 3.0, 6.0]",
        "capsules not yet deleted: 0",
        "after: [1.0, 1.0, 1.0]",
    ]


def test_nccl_demanded_runs_a_single_rank_through_nccl():
    """RVOD_GPU_TRANSPORT=nccl forces the NCCL route: one rank on its own GPU takes it (a one-rank communicator)."""
    code = """
import os
os.environ["RVOD_GPU_TRANSPORT"] = "nccl"
os.environ["RVOD_LOG_LEVEL"] = "info"
import numpy as np, gpu_standin as g
import rvod.numpy as hvd
from rvod import _rvod
print(_rvod.gpu_libraries()["nccl_collectives"])
hvd.init()
result = hvd.allreduce(g.DeviceArray(np.arange(3, dtype=np.float32)), name="w", postscale_factor=2.0)
print(g.read_capsule(result.__dlpack__())[1].tolist())
hvd.shutdown()
"""
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True", "[0.0, 2.0, 4.0]"], result.stdout + result.stderr
    assert ("process set 0: GPU collectives via NCCL (rank 0 on GPU 0): RVOD_GPU_TRANSPORT=nccl; NCCL 2.21.5"
            in result.stderr), result.stderr


def test_rvod_reports_a_missing_driver_or_device_in_cudas_words():
    code = "from rvod import _rvod; print(_rvod.gpu_libraries()['unavailable'])"
    assert python(code, no_driver=1).stdout.strip() == (
        "no CUDA driver: CUDA driver version is insufficient for CUDA runtime version (cudaErrorInsufficientDriver)")
    assert python(code, devices=0).stdout.strip() == "no CUDA device: no CUDA-capable device is detected (cudaErrorNoDevice)"
