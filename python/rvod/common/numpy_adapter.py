"""NumPy arrays across to the engine: zero copy for C-contiguous arrays of native byte order.

Plain ``ndarray``s go as they are: the engine reads them straight from NumPy's array struct, which costs far
less than a DLPack capsule per array (it matters for a grouped allreduce of a thousand gradients). Anything else
(subclasses, array-likes, non-contiguous or foreign-byte-order arrays, read-only arrays for in-place ops)
crosses by DLPack, as a private contiguous copy where needed; dtypes the engine cannot reduce, and bfloat16
(which NumPy cannot export), are refused with a ``TypeError`` naming the dtype before anything is sent.

Objects in GPU memory (``__dlpack_device__`` says CUDA, e.g. a CuPy array) go as they are, where rvod can use
the GPU: ``__dlpack__(stream=...)`` is given rvod's stream on that device (the DLPack protocol: the producer
makes its data ready there), in-place ops write into their memory, and a new result is a :class:`DeviceResult`
(an object with ``__dlpack__``, for the framework's own ``from_dlpack``). The caller's ``synchronize`` waits on
the host for the results.
"""

import numpy as np

from rvod import _rvod
from rvod.common.ops import TensorAdapter
from rvod.exceptions import RvodInvalidArgumentError

# The engine's element types (its own table, by name) that NumPy has: all but bfloat16.
_SUPPORTED = tuple(np.dtype(name) for name in _rvod.DTYPES if name != "bfloat16")
_SUPPORTED_NAMES = ", ".join(d.name for d in _SUPPORTED)
# (kind, itemsize) of the supported dtypes: a set lookup is far cheaper than comparing dtype objects (export
# runs for every tensor of every collective), and it also accepts aliases such as longlong for int64.
_SUPPORTED_KINDS = frozenset((d.kind, d.itemsize) for d in _SUPPORTED)
# NumPy's bfloat16 (ml_dtypes') is a dtype NumPy itself cannot export by DLPack, so the engine never sees it.
_BFLOAT16_HINT = (" (NumPy bfloat16 arrays, such as ml_dtypes', cannot be exported; send a framework tensor such as "
                  "torch.bfloat16, or cast to float32)")


class HostCapsule:
    """An engine-produced host capsule as an object with ``__dlpack__`` (what ``np.from_dlpack`` and
    ``jax.dlpack.from_dlpack`` take; newer versions of both take no bare capsules)."""

    __slots__ = ("capsule",)

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


# DLPack device types whose memory NumPy can read (CPU, CUDA host-pinned); others (CUDA, ROCm) are device memory.
_HOST_DEVICES = (1, 3)
_CUDA = 2


class DeviceResult:
    """A result rvod made on a GPU: hand it to the framework's ``from_dlpack`` (once). ``device`` is the
    CUDA ordinal; ``shape`` and ``dtype`` are read from the capsule by the consumer."""

    __slots__ = ("capsule", "device")

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, stream=None, **kwargs):
        # The results are complete on the host's view of the device (``synchronize`` waited for them).
        capsule, self.capsule = self.capsule, None
        if capsule is None:
            raise BufferError("this rvod result was already handed to a consumer")
        return capsule

    def __dlpack_device__(self):
        return (_CUDA, self.device)


def _on_device(tensor):
    """The CUDA ordinal of an object in GPU memory, else None."""
    if isinstance(tensor, np.ndarray) or not hasattr(tensor, "__dlpack_device__"):
        return None
    device_type, ordinal = tensor.__dlpack_device__()
    return None if device_type in _HOST_DEVICES else ordinal


class NumpyAdapter(TensorAdapter):
    def export(self, tensor):
        ordinal = _on_device(tensor)
        if ordinal is not None:
            # Device memory (e.g. a CuPy array): made ready on rvod's stream, where rvod can use the GPU (else
            # the engine says why it cannot).
            try:
                stream = _rvod.device_stream(ordinal)
            except (TypeError, ValueError):
                return tensor.__dlpack__(), tensor
            return tensor.__dlpack__(stream=stream), tensor
        array = tensor if isinstance(tensor, np.ndarray) else np.from_dlpack(tensor) if hasattr(
            tensor, "__dlpack__") else np.asarray(tensor)
        dtype = array.dtype
        if not dtype.isnative:
            array = array.astype(dtype.newbyteorder("="))
        if (dtype.kind, dtype.itemsize) not in _SUPPORTED_KINDS:
            raise TypeError(f"rvod cannot exchange arrays of dtype {array.dtype}; supported: {_SUPPORTED_NAMES}"
                            f"{_BFLOAT16_HINT if dtype.name == 'bfloat16' else ''}")
        holder = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        if not holder.flags.writeable:
            # DLPack cannot export read-only arrays; the engine reads a private copy instead.
            holder = holder.copy()
        return holder.__dlpack__(), holder

    def export_unchecked(self, tensors, for_write):
        # The engine takes exact ndarrays as they are and refuses anything else (a subclass such as a masked
        # array may mean more than its memory says; lists, scalars), which then comes back through export().
        return tensors

    tensors_are_ndarrays = True

    def from_ndarray(self, array):
        return array

    def from_dlpack(self, capsule):
        device = _rvod.capsule_device(capsule)
        if device is not None and device[0] == _CUDA:
            return DeviceResult(capsule, device[1])
        if _rvod.relabel_bool_as_uint8(capsule):  # NumPy < 1.25 imports no DLPack bool: uint8, viewed as bool
            return np.from_dlpack(HostCapsule(capsule)).view(np.bool_)
        return np.from_dlpack(HostCapsule(capsule))

    def copy_(self, dst, src):
        np.copyto(dst, src)

    def export_for_write(self, tensor):
        """Refuse, before anything is sent, an in-place op on something its result cannot be written to.
        (Contiguous ndarrays of native byte order never get here: the engine reads and checks those itself.)"""
        if _on_device(tensor) is not None:
            return self.export(tensor)
        if not isinstance(tensor, np.ndarray):
            raise TypeError(f"in-place ops need a NumPy array to write the result into, got {type(tensor).__name__}")
        if not tensor.flags.writeable:
            raise RvodInvalidArgumentError("in-place ops need a writable array; this one is read-only")
        return self.export(tensor)

    def to_int_list(self, values):
        return [int(v) for v in np.asarray(values).reshape(-1)]
