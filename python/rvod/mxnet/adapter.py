"""MXNet NDArrays across the DLPack boundary, without a copy either way.

MXNet runs its ops asynchronously, on its own threads. Before an NDArray crosses, every op MXNet has
queued is finished (``mx.nd.waitall()``), not only those on that array: an op that only reads an array can
queue a change of its layout (MKL-DNN does so with weights during inference), which a per-array wait can
miss, and the engine reads and writes the array's memory outside MXNet's knowledge. Inputs are exported
with ``to_dlpack_for_read`` and arrays in-place ops write into with ``to_dlpack_for_write``; results come
back as NDArrays viewing the engine's buffer (``mx.nd.from_dlpack``), and inputs of the ``mx.np`` flavour
get ``mx.np`` results. Ops are synchronous, so MXNet sees an in-place result as soon as the op returns.

MXNet 1.9 NDArrays are dense and C-contiguous, except that after inference its MKL-DNN backend may keep
an array (typically a convolution weight) in a blocked layout DLPack cannot describe: such an array is put
back into the plain layout first, as reading it with ``asnumpy()`` would. What the engine cannot take is
refused with a ``ValueError`` before anything is sent: arrays on a GPU (this build is CPU-only), sparse
storage, and ``bool`` (MXNet 1.9 cannot import a bool DLPack tensor, so no result could come back).
"""

import ctypes

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from rvod.common.ops import TensorAdapter
from rvod.exceptions import RvodInvalidArgumentError

BFLOAT16 = np.dtype([("bfloat16", np.uint16)])  # how MXNet 1.9 spells its bfloat16 dtype
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32,
                                                np.float64)) + (BFLOAT16,)
_SUPPORTED_NAMES = "uint8, int8, int32, int64, float16, bfloat16, float32, float64"


def dtype_name(dtype):
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


def check_ndarray(tensor, what="rvod.mxnet"):
    """Raise unless ``tensor`` is a dense CPU NDArray of a dtype that can make the round trip."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what} expects an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.context.device_type == "gpu":
        raise RvodInvalidArgumentError(f"{what}: got an NDArray on {tensor.context}; GPU support needs an rvod build with NCCL, "
                         "and this build handles CPU NDArrays only. Move it with .as_in_context(mx.cpu()).")
    if tensor.stype != "default":
        raise RvodInvalidArgumentError(f"{what}: {tensor.stype} NDArrays are not supported; convert with .tostype('default')")
    dtype = np.dtype(tensor.dtype)
    if dtype not in SUPPORTED_DTYPES:
        hint = " (MXNet 1.9 cannot import bool DLPack tensors; cast with .astype('uint8'))" if dtype == np.bool_ else ""
        raise RvodInvalidArgumentError(f"Tensor type {dtype_name(dtype)} is not supported{hint}; supported: {_SUPPORTED_NAMES}")


def _to_default_layout(tensor):
    """Convert an array MKL-DNN keeps in its blocked layout back to the plain layout, in place (what
    ``MXNDArrayGetData`` does; nothing is queued on the array any more)."""
    check_call(_LIB.MXNDArrayGetData(tensor.handle, ctypes.byref(ctypes.c_void_p())))


def _capsule(tensor, for_write):
    check_ndarray(tensor)
    mx.nd.waitall()
    export = tensor.to_dlpack_for_write if for_write else tensor.to_dlpack_for_read
    try:
        return export()
    except mx.base.MXNetError as error:
        if "MKLDNN" not in str(error):
            raise
    _to_default_layout(tensor)
    return export()


class MXNetAdapter(TensorAdapter):
    """Every input is exported as it is, so in-place results are already in place (no copy back)."""

    def export(self, tensor):
        return _capsule(tensor, for_write=False), tensor

    def export_for_write(self, tensor):
        return _capsule(tensor, for_write=True), tensor

    def from_dlpack(self, capsule):
        return mx.nd.from_dlpack(capsule)

    def to_int_list(self, values):
        if isinstance(values, mx.nd.NDArray):
            return [int(v) for v in values.asnumpy().reshape(-1)]
        return [int(v) for v in values]

    def received_splits(self, splits):
        return mx.nd.array(list(splits), dtype=np.int32)


class NumpyFlavourAdapter(MXNetAdapter):
    """For ``mx.np`` inputs: results are ``mx.np.ndarray`` too."""

    def from_dlpack(self, capsule):
        return mx.nd.from_dlpack(capsule).as_np_ndarray()

    def received_splits(self, splits):
        return super().received_splits(splits).as_np_ndarray()


_LEGACY = MXNetAdapter()
_NUMPY = NumpyFlavourAdapter()


def adapter_for(tensors):
    """The adapter whose results have the flavour (``mx.nd`` or ``mx.np``) of the first input."""
    first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
    return _NUMPY if isinstance(first, mx.np.ndarray) else _LEGACY
