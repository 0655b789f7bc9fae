"""torch tensors across the DLPack boundary.

A contiguous CPU tensor crosses without a copy (the engine reads, and for in-place ops writes, its memory);
any other CPU tensor (transposed, strided, with the negative bit set) crosses as a private contiguous copy
whose result is copied back. CUDA tensors cross as DLPack capsules of device memory, with the current stream
of their device (the engine records the tensor's ready event on it), and results come back on the device,
the current stream made to wait for them; where rvod cannot use the GPU the engine refuses them with the
reason (a ``ValueError`` naming the tensor; see ``rvod.common.basics.nccl_built``). Tensors on other devices
and dtypes the engine cannot exchange are refused with a ``ValueError`` before anything is sent. (Not yet run
on a GPU: the CUDA path is tested with the GPU stand-in through rvod.numpy only.)
"""

import torch
from torch.utils import dlpack

from rvod.common.ops import TensorAdapter
from rvod.exceptions import RvodInvalidArgumentError

_to_dlpack = dlpack.to_dlpack

try:
    # A device's current stream as a number, without building a torch.cuda.Stream (what torch.compile's
    # generated code calls on every kernel launch).
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # a torch without it (or without CUDA, where no tensor asks)
    def _current_stream(device_index):
        return torch.cuda.current_stream(device_index).cuda_stream

SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                    torch.float32, torch.float64, torch.bool) + ((torch.uint16,) if hasattr(torch, "uint16") else ())
_SUPPORTED_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)


def check_tensor(tensor, what="rvod"):
    """Raise unless ``tensor`` is a dense CPU tensor of a dtype the engine exchanges."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_cpu and tensor.layout is torch.strided and tensor.dtype in _SUPPORTED_SET:
        return  # the common case, checked with cheap attributes only (this runs on every collective)
    if tensor.device.type == "cuda" and tensor.layout is torch.strided and tensor.dtype in _SUPPORTED_SET:
        return  # the engine reads the device from the capsule and says whether it can use it here
    if tensor.device.type not in ("cpu", "cuda"):
        raise RvodInvalidArgumentError(f"{what}: tensors on device '{tensor.device.type}' are not supported; use CPU tensors")
    if tensor.layout != torch.strided:
        raise RvodInvalidArgumentError(f"{what}: {tensor.layout} tensors are not supported here; use sparse_allreduce_async "
                         "for sparse tensors, or convert with .to_dense()")
    raise RvodInvalidArgumentError(f"Tensor type {tensor.type()} is not supported (dtype {tensor.dtype}); "
                     f"supported: {_SUPPORTED_NAMES}")


class TorchAdapter(TensorAdapter):
    def export(self, tensor):
        check_tensor(tensor)
        data = tensor.detach() if tensor.requires_grad else tensor
        if data.is_contiguous() and not data.is_neg():
            return dlpack.to_dlpack(data), tensor
        copy = data.resolve_neg().contiguous()
        return dlpack.to_dlpack(copy), copy

    def export_unchecked(self, tensors, for_write):
        try:
            if any(map(torch.Tensor.is_neg, tensors)):
                return None  # DLPack cannot carry the negative bit
            return list(map(dlpack.to_dlpack, tensors))
        except Exception:  # noqa: BLE001 - not a tensor, or one DLPack cannot describe (sparse, meta, ...)
            return None  # export() explains

    def export_one(self, tensor):
        try:
            return None if tensor.is_neg() else _to_dlpack(tensor)  # DLPack cannot carry the negative bit
        except Exception:  # noqa: BLE001 - not a tensor, or one DLPack cannot describe (sparse, meta, ...)
            return None  # export() explains

    def as_ndarray(self, tensor):
        try:
            if tensor.requires_grad or not tensor.is_cpu:
                # numpy() refuses both; export() detaches the one, and a CUDA tensor crosses by DLPack (asking
                # numpy() would raise, and cost, a C++ exception on every op).
                return None
            return tensor.numpy()  # a view of the tensor's memory
        except Exception:  # noqa: BLE001 - nothing numpy() can view (bfloat16, sparse, neg bit, not a tensor)
            return None

    def from_ndarray(self, array):
        return torch.from_numpy(array)

    def from_dlpack(self, capsule):
        return dlpack.from_dlpack(capsule)

    def copy_(self, dst, src):
        # In-place results bypass autograd, as Horovod's do: parameters that require grad can be written.
        with torch.no_grad():
            dst.copy_(src)

    def to_int_list(self, values):
        if isinstance(values, torch.Tensor):
            return [int(v) for v in values.reshape(-1).tolist()]
        return [int(v) for v in values]

    def received_splits(self, splits):
        return torch.tensor(list(splits), dtype=torch.int32)

    def stream_of(self, tensor):
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            return _current_stream(tensor.get_device())
        return None

    def consumer_stream(self):
        # Results on a GPU are used on the current stream next; without CUDA there are none.
        if torch.cuda.is_initialized():
            return _current_stream(torch.cuda.current_device())
        return None
