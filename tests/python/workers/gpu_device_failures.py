"""Rank script: a GPU op that fails must raise on every rank, never hang. FAILURE says how:

- ``dead``: rank 1's process ends abruptly (no shutdown) after a first device allreduce; the others' next one
  raises. It exits with status 0, so that rvodrun does not stop the others before they see the loss (a rank
  that fails makes rvodrun stop the job, which on a fast machine came before rank 0's error).
- ``cuda``: rank 1's copy of its input to the host fails (an injected ``cudaErrorMemoryAllocation``); rank 1
  raises with the rank, the GPU, the call and CUDA's words, and the others raise too.
- ``oom``: the second op is an allgather whose result does not fit in the GPU's memory (run with a small
  RVOD_STANDIN_DEVICE_MEMORY): every rank raises, naming the allocation.

Each rank prints ``raised <class>: <message>`` (or ``no error``) and ``finished``.
"""

import os
import sys

if os.environ.get("FAILURE") == "cuda" and os.environ.get("RVOD_RANK") == "1":
    os.environ["RVOD_STANDIN_FAIL"] = "cudaMemcpyAsync:3:2"  # the first op takes two (to the host and back)

import numpy as np  # noqa: E402

sys.path.insert(0, os.environ["STANDIN_DIR"])
import gpu_standin as g  # noqa: E402

import rvod.numpy as hvd  # noqa: E402

hvd.init()
rank = hvd.rank()
first = hvd.allreduce(g.DeviceArray(np.ones(4, np.float32)), op=hvd.Sum, name="first")
print("first", g.read_capsule(first.__dlpack__())[1].tolist(), flush=True)
if os.environ["FAILURE"] == "dead" and rank == 1:
    os._exit(0)
try:
    if os.environ["FAILURE"] == "oom":
        hvd.allgather(g.DeviceArray(np.ones(12 * 1024, np.float32)), name="second")
    else:
        hvd.allreduce(g.DeviceArray(np.ones(4, np.float32)), op=hvd.Sum, name="second")
    print("no error", flush=True)
except Exception as error:  # noqa: BLE001 - the test reads the class and the message
    print(f"raised {type(error).__name__}: {error}", flush=True)
print("finished", flush=True)
os._exit(0)
