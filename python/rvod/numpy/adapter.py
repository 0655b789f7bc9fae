"""NumPy arrays across the DLPack boundary: zero copy for C-contiguous writable arrays."""

import numpy as np

from rvod.common.ops import TensorAdapter


class _CapsuleHolder:
    """Makes an engine-produced capsule importable by ``np.from_dlpack``."""

    __slots__ = ("capsule",)

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


class NumpyAdapter(TensorAdapter):
    def export(self, tensor):
        array = tensor if isinstance(tensor, np.ndarray) else np.from_dlpack(tensor) if hasattr(
            tensor, "__dlpack__") else np.asarray(tensor)
        holder = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        try:
            return holder.__dlpack__(), holder
        except BufferError:
            # Read-only arrays cannot be exported; the engine reads a private copy instead.
            holder = holder.copy()
            return holder.__dlpack__(), holder

    def from_dlpack(self, capsule):
        return np.from_dlpack(_CapsuleHolder(capsule))

    def copy_(self, dst, src):
        np.copyto(dst, src)

    def to_int_list(self, values):
        return [int(v) for v in np.asarray(values).reshape(-1)]
