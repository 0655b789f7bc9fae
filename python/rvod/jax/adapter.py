"""jax.Arrays across the DLPack boundary, without a copy either way.

An input crosses as its own DLPack capsule (``jax.Array.__dlpack__``, which waits until the array is
computed; bfloat16 included, which NumPy cannot export); a result comes back as a jax.Array viewing the
engine's buffer (``jax.dlpack.from_dlpack``: the engine's buffers are 64-byte aligned, as XLA wants; a
result that is not is copied). Inputs that are not jax.Arrays (NumPy arrays, lists, the NumPy arrays older JAX versions hand a
host callback) are made jax.Arrays first. jax.Arrays are immutable, so no op writes into its input.
Arrays on a device other than the CPU, and dtypes the engine cannot exchange, are refused with a
``TypeError`` naming the device or dtype before anything is sent.
"""

import jax
import jax.numpy as jnp
import numpy as np

from rvod.common.numpy_adapter import HostCapsule, NumpyAdapter
from rvod.common.ops import DTYPE_NAMES, TensorAdapter

# The engine's element types (jax's dtype names are the same: bfloat16 is ml_dtypes'), as dtypes: a set lookup
# of a dtype costs far less than its name.
SUPPORTED_DTYPES = frozenset(jnp.dtype(name) for name in DTYPE_NAMES)
_SUPPORTED_NAMES = ", ".join(sorted(DTYPE_NAMES))


def as_array(value, what="rvod.jax"):
    """``value`` as a jax.Array on the CPU of a dtype the engine exchanges, else a ``TypeError``."""
    # jax.device_put, not jnp.asarray: eagerly, jnp.asarray of a NumPy array compiles an XLA program per shape.
    array = value if isinstance(value, jax.Array) else jax.device_put(np.asarray(value))
    if array.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} cannot exchange arrays of dtype {array.dtype.name}; supported: {_SUPPORTED_NAMES}")
    platforms = {device.platform for device in array.devices()}
    if platforms != {"cpu"}:
        raise TypeError(f"{what} exchanges arrays in host memory; this one is on {', '.join(sorted(platforms))} "
                        "(jax.device_put it to jax.devices('cpu')[0])")
    return array


class JaxAdapter(TensorAdapter):
    def export(self, tensor):
        array = as_array(tensor)
        return array.__dlpack__(), array

    def export_one(self, tensor):
        # The engine refuses what it cannot take (a dtype, a device); export() then explains.
        return tensor.__dlpack__() if isinstance(tensor, jax.Array) else None

    def export_unchecked(self, tensors, for_write):
        if all(isinstance(t, jax.Array) for t in tensors):
            return [t.__dlpack__() for t in tensors]
        return None

    def from_dlpack(self, capsule):
        # Zero copy where the buffer is aligned as XLA wants (the engine's own allocations are); a result the
        # engine hands out of a larger buffer (a reducescatter's share) may not be, and is copied.
        return jax.dlpack.from_dlpack(HostCapsule(capsule))

    def from_ndarray(self, array):
        return jax.device_put(array)

    def copy_(self, dst, src):
        raise TypeError("jax.Arrays are immutable: rvod.jax has no in-place ops")

    def to_int_list(self, values):
        return [int(v) for v in np.asarray(values).reshape(-1).tolist()]

    def received_splits(self, splits):
        return jax.device_put(np.asarray(splits, dtype=np.int32))


class HostResultsAdapter(JaxAdapter):
    """Inside a host callback of a compiled program: results are NumPy arrays viewing the engine's buffers,
    which JAX copies into its own buffers as it does any callback's results (jax.Arrays made of them first
    would cost a copy more where the buffer is not aligned as XLA wants). Not for bfloat16 results, which
    NumPy cannot import."""

    _numpy = NumpyAdapter()

    def from_dlpack(self, capsule):
        return self._numpy.from_dlpack(capsule)
