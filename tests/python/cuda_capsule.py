"""A DLPack capsule of "device memory" on a CUDA device, made with ctypes: no GPU or driver is needed.

The engine must refuse it by its device before reading a byte (its data pointer is not valid memory). Used by
test_gpu.py, in a subprocess.
"""

import ctypes

# DLPack's structures, declared once for the tests (gpu_standin.py; importing it builds nothing).
from gpu_standin import DLManagedTensor as _DLManagedTensor
from gpu_standin import _DLDataType, _DLDevice, _DLTensor


class FakeCudaArray:
    """An array-like on CUDA device ``device`` as far as DLPack says (as a CuPy array would be); with
    ``device_type=1`` a CPU array whose ``shape`` is whatever the test claims (its data is never valid)."""

    def __init__(self, device=0, shape=(4,), device_type=2):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.managed = _DLManagedTensor(_DLTensor(0xDEAD0000, _DLDevice(device_type, device), len(shape),
                                                  _DLDataType(2, 32, 1), self.shape, None, 0), None, None)
        self.device = device
        self.device_type = device_type

    def __dlpack_device__(self):
        return (self.device_type, self.device)

    def __dlpack__(self, stream=None, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor", None)
