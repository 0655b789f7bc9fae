"""Rank script: a device result the framework frees while a kernel queued on its stream still reads it is not
overwritten by rvod's next op, which reuses the buffer (tests/python/test_gpu_device_path.py).

Each rank allreduces ones (result: size), and waits for it with a consumer stream; a slow framework kernel
(RVOD_STANDIN_KERNEL_US) and then a copy of the result are queued on that stream, and the result is freed at
once, as a framework frees a tensor its host code dropped. The next allreduce, of twos and the same size,
gets the same device buffer from rvod's pool. The copy must still see the first result. Prints
``case reuse <same buffer: True/False>`` and ``case read ok`` (or WRONG with the values).
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

hvd.init()
N, size = 4096, hvd.size()
lib = g.load()
consumer = g.new_stream(0)  # the framework's current stream (non-blocking, as torch's side streams)


def allreduce(value, name):
    """An out-of-place allreduce of `value`s on GPU 0, its result made ready on the consumer stream."""
    tensor = g.DeviceArray(np.full(N, value, np.float32))
    capsule = tensor.__dlpack__(stream=_rvod.device_stream(0))
    handle = _rvod.submit(ALLREDUCE, [name], [capsule], False, Sum, 1.0, 1.0, -1, 0)
    (result,), _, _ = _rvod.wait(handle, consumer)
    return tensor, result


first_input, first = allreduce(1.0, "pool.first")
first_address = g.capsule_tensor(first).data
copy = g.DeviceArray(np.zeros(N, np.float32))
busy = g.DeviceArray(np.zeros(N, np.float32))
busy.write_async(np.ones(N, np.float32), stream=consumer)  # a slow framework kernel
g.check(lib.cudaMemcpyAsync(copy.ptr, first_address, N * 4, 3, consumer))  # then the result is read
del first  # freed by the framework now: the memory goes back to rvod's pool
second_input, second = allreduce(2.0, "pool.second")
print("case reuse", g.capsule_tensor(second).data == first_address, flush=True)
read = copy.to_numpy(stream=consumer)
print("case read", "ok" if np.all(read == size) else f"WRONG {read[:4].tolist()}", flush=True)
_, after = g.read_capsule(second)
print("case second", "ok" if np.all(after == 2 * size) else f"WRONG {after[:4].tolist()}", flush=True)
hvd.shutdown()
