"""The GPU stand-in for tests (a support module, not a test file).

``tests/gpu_standin/`` is a small C library that exports the CUDA runtime and NCCL functions rvod loads, on host
memory (see its README.md for the exported functions and settings). This module builds it (cached by the hash
of its sources, under the temporary directory), loads it with ctypes, gives the environment that makes rvod
load it (:func:`env`), and offers :class:`DeviceArray`: an array in stand-in device memory that speaks DLPack as
a CUDA array does. Where no C compiler is found, :func:`library_path` raises :class:`StandinUnavailable` with the
reason, for tests to skip on.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCES = Path(__file__).resolve().parent.parent / "gpu_standin"
# The flags the Rust test (tests/gpu_standin.rs) uses too: both hash them with the sources into one cache path.
FLAGS = ("-shared", "-fPIC", "-O2", "-pthread")
LIBRARY_NAME = "librvod_gpu_standin.so"
KDL_CUDA = 2
LEGACY_STREAM = 1
MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST = 1, 2


class StandinUnavailable(RuntimeError):
    """The stand-in cannot be built here (no C compiler); the message says why."""


def source_hash() -> str:
    """sha256 over the flags and every source file (name and bytes, by name): the cache key."""
    digest = hashlib.sha256(" ".join(FLAGS).encode() + b"\0")
    for path in sorted(p for p in SOURCES.iterdir() if p.suffix in (".c", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def library_path() -> Path:
    """The built library, compiling it first when this version of the sources has not been built yet."""
    target = Path(tempfile.gettempdir()) / f"rvod-gpu-standin-{os.getuid()}" / source_hash()[:16] / LIBRARY_NAME
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise StandinUnavailable(f"no C compiler ({os.environ.get('CC', 'cc')} is not on PATH) to build the GPU stand-in")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{LIBRARY_NAME}.{os.getpid()}.partial")
    sources = sorted(str(p) for p in SOURCES.glob("*.c"))
    built = subprocess.run([compiler, *FLAGS, "-o", str(partial), *sources], capture_output=True, text=True,
                           timeout=120)
    if built.returncode != 0:
        raise RuntimeError(f"building the GPU stand-in failed:\n{built.stderr}")
    os.replace(partial, target)  # atomic: concurrent builders leave one complete file
    return target


def library_or_skip() -> Path:
    """The stand-in library, or a module-level skip saying why it cannot be built (for test modules)."""
    import pytest

    try:
        return library_path()
    except StandinUnavailable as why:
        pytest.skip(str(why), allow_module_level=True)


def env(**settings: object) -> dict[str, str]:
    """The variables that make rvod load the stand-in, plus ``RVOD_STANDIN_*`` settings given by their suffix
    (``env(devices=3, stream_delay_us=2000)``)."""
    path = str(library_path())
    variables = {"RVOD_CUDA_LIBRARY": path, "RVOD_NCCL_LIBRARY": path}
    variables.update({f"RVOD_STANDIN_{name.upper()}": str(value) for name, value in settings.items()})
    return variables


_LIBRARY: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The stand-in loaded into this process (settings are read from os.environ on first use)."""
    global _LIBRARY
    if _LIBRARY is None:
        lib = ctypes.CDLL(str(library_path()))
        p, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        signatures = {
            "cudaSetDevice": [i], "cudaMalloc": [ctypes.POINTER(p), size], "cudaFree": [p],
            "cudaMemcpy": [p, p, size, i], "cudaMemcpyAsync": [p, p, size, i, p], "cudaStreamSynchronize": [p],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(p), ctypes.c_uint], "cudaStreamDestroy": [p],
            "cudaEventCreateWithFlags": [ctypes.POINTER(p), ctypes.c_uint], "cudaEventRecord": [p, p],
            "cudaStreamWaitEvent": [p, p, ctypes.c_uint], "cudaEventDestroy": [p], "cudaEventQuery": [p],
            "cudaDeviceSynchronize": [], "standin_kernel_write": [p, p, p, size], "standin_read": [p, p, size],
            "standin_live": [ctypes.c_char_p], "standin_calls": [ctypes.c_char_p],
        }
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes = argtypes
        lib.standin_live.restype = lib.standin_calls.restype = ctypes.c_long
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        _LIBRARY = lib
    return _LIBRARY


def calls(*names: str) -> dict[str, int]:
    """How many times each of ``names`` (CUDA or NCCL functions) was called in this process so far (the stand-in's
    ``standin_calls``)."""
    lib = load()
    return {name: lib.standin_calls(name.encode()) for name in names}


class CudaError(RuntimeError):
    pass


def check(status: int) -> None:
    """Raise CudaError with CUDA's name and text for a failed call."""
    if status != 0:
        lib = load()
        raise CudaError(f"{lib.cudaGetErrorName(status).decode()}: {lib.cudaGetErrorString(status).decode()}")


def new_stream(device: int) -> int:
    """A non-blocking stream on ``device`` (its handle as an int, as ``torch.cuda.Stream.cuda_stream``)."""
    lib = load()
    check(lib.cudaSetDevice(device))
    handle = ctypes.c_void_p()
    check(lib.cudaStreamCreateWithFlags(ctypes.byref(handle), 1))
    return handle.value


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Capsules handed out and not yet deleted: address of the DLManagedTensor -> what it keeps alive.
_exported: dict[int, tuple] = {}


@_DELETER
def _delete_managed(address):
    _exported.pop(address, None)


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Private prototypes: ctypes.pythonapi's attributes are shared objects whose argtypes any caller may change.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule):
    # An unconsumed capsule ("dltensor") still owns its tensor; a consumer renames it "used_dltensor".
    if _capsule_is_valid(capsule, b"dltensor"):
        _delete_managed(_capsule_pointer(capsule, b"dltensor"))


_DLPACK_DTYPES = {(0, 8): np.int8, (0, 16): np.int16, (0, 32): np.int32, (0, 64): np.int64, (1, 8): np.uint8,
                  (1, 16): np.uint16, (2, 16): np.float16, (2, 32): np.float32, (2, 64): np.float64, (6, 8): np.bool_}


def capsule_tensor(capsule) -> _DLTensor:
    """The DLTensor an unconsumed ``dltensor`` capsule holds (a view: valid while the capsule lives)."""
    return DLManagedTensor.from_address(_capsule_pointer(id(capsule), b"dltensor")).dl_tensor


def read_capsule(capsule) -> tuple[int, np.ndarray]:
    """``(device, values)`` of an unconsumed ``dltensor`` capsule on a stand-in GPU (rvod's results), copied to the
    host with a synchronous cudaMemcpy (which waits for the device's work, as CUDA's does). The capsule is not
    consumed: its destructor still returns the memory to whoever made it."""
    tensor = capsule_tensor(capsule)
    if tensor.device.device_type != KDL_CUDA:
        raise ValueError(f"not a CUDA capsule: device type {tensor.device.device_type}")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    out = np.empty(shape, _DLPACK_DTYPES[(tensor.dtype.code, tensor.dtype.bits)])
    lib = load()
    check(lib.cudaSetDevice(tensor.device.device_id))
    if out.nbytes:
        check(lib.cudaMemcpy(out.ctypes.data, tensor.data + tensor.byte_offset, out.nbytes, MEMCPY_DEVICE_TO_HOST))
    return tensor.device.device_id, out


def exported_capsules() -> int:
    """How many capsules this module made whose deleter has not run yet."""
    return len(_exported)


def _dlpack_dtype(dtype: np.dtype) -> _DLDataType:
    code = {"i": 0, "u": 1, "f": 2, "b": 6}[dtype.kind]
    return _DLDataType(code, dtype.itemsize * 8, 1)


class DeviceArray:
    """An array in stand-in device memory on GPU ``device``, made from a NumPy array.

    ``stream`` is the stream its pending work is on (as a framework's current stream; 0 is the legacy default
    stream). ``__dlpack__(stream=s)`` follows the DLPack stream protocol: the data is made ready on the consumer's
    stream ``s`` (None means the legacy default stream, -1 no synchronization) by recording an event on this
    array's stream and making ``s`` wait for it.
    """

    def __init__(self, values, device: int = 0, stream: int = 0):
        lib = load()
        host = np.ascontiguousarray(values)
        self.dtype, self.shape, self.device, self.stream = host.dtype, host.shape, device, stream
        self.nbytes = host.nbytes
        check(lib.cudaSetDevice(device))
        pointer = ctypes.c_void_p()
        check(lib.cudaMalloc(ctypes.byref(pointer), self.nbytes))
        self.ptr = pointer.value or 0
        if self.nbytes:
            check(lib.cudaMemcpy(self.ptr, host.ctypes.data, self.nbytes, MEMCPY_HOST_TO_DEVICE))

    def write_async(self, values, stream: int | None = None) -> None:
        """A framework kernel that writes ``values`` on ``stream`` (default: this array's); it runs when the
        stream reaches it. The array's stream becomes ``stream``."""
        lib = load()
        host = np.ascontiguousarray(values, dtype=self.dtype).reshape(self.shape)
        self.stream = self.stream if stream is None else stream
        check(lib.cudaSetDevice(self.device))
        check(lib.standin_kernel_write(self.stream, self.ptr, host.ctypes.data, self.nbytes))

    def to_numpy(self, stream: int | None = None) -> np.ndarray:
        """The values once ``stream`` (default: this array's) has run what it holds: a copy on that stream,
        then a wait for it (as ``tensor.cpu()``)."""
        lib = load()
        out = np.empty(self.shape, self.dtype)
        stream = self.stream if stream is None else stream
        check(lib.cudaSetDevice(self.device))
        if self.nbytes:
            check(lib.cudaMemcpyAsync(out.ctypes.data, self.ptr, self.nbytes, MEMCPY_DEVICE_TO_HOST, stream))
        check(lib.cudaStreamSynchronize(stream))
        return out

    def peek(self) -> np.ndarray:
        """The bytes in device memory right now, whatever the streams still hold (no waiting)."""
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            check(load().standin_read(self.ptr, out.ctypes.data, self.nbytes))
        return out

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device)

    def __dlpack__(self, stream: int | None = None, max_version=None, dl_device=None, copy=None):
        if stream == 0:
            raise ValueError("stream 0 is ambiguous for CUDA in the DLPack protocol: pass 1 (legacy) or 2 (per-thread)")
        if stream is None:
            stream = LEGACY_STREAM
        if stream != -1 and stream != self.stream and {stream, self.stream} != {0, LEGACY_STREAM}:
            lib = load()
            current = ctypes.c_int(0)  # kept for the caller, as a framework's device guard does
            check(lib.cudaGetDevice(ctypes.byref(current)))
            check(lib.cudaSetDevice(self.device))
            event = ctypes.c_void_p()
            check(lib.cudaEventCreateWithFlags(ctypes.byref(event), 2))
            check(lib.cudaEventRecord(event, self.stream))
            check(lib.cudaStreamWaitEvent(stream, event, 0))
            check(lib.cudaEventDestroy(event))
            check(lib.cudaSetDevice(current.value))
        shape = (ctypes.c_int64 * max(len(self.shape), 1))(*self.shape)
        tensor = _DLTensor(self.ptr or None, _DLDevice(KDL_CUDA, self.device), len(self.shape), _dlpack_dtype(self.dtype),
                           shape, None, 0)
        managed = DLManagedTensor(tensor, None, ctypes.cast(_delete_managed, ctypes.c_void_p).value)
        address = ctypes.addressof(managed)
        _exported[address] = (managed, shape, self)
        return _capsule_new(address, b"dltensor", ctypes.cast(_capsule_destructor, ctypes.c_void_p).value)

    def free(self) -> None:
        """cudaFree (which waits for the device's work first, as CUDA's does)."""
        if self.ptr:
            check(load().cudaFree(self.ptr))
            self.ptr = 0
