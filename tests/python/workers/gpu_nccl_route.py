"""Rank script: the NCCL route of GPU collectives against the GPU stand-in, 2 ranks, rank r on GPU r (GPU_OF_RANK
"same": both on GPU 0). SCENARIO says what happens:

- ``join``: rank 1 runs one allreduce and joins; rank 0 then runs a single, an in-place and a fused (grouped)
  allreduce, in which the joined rank takes part with zeros, then joins.
- ``join_first``: rank 1 joins before it ever submitted a GPU tensor; rank 0's allreduce still runs (rank 1 has
  no GPU to take part in NCCL with, so the set stages).
- ``plain``: one allreduce (the test sets RVOD_GPU_TRANSPORT and GPU_OF_RANK), then one of host arrays.
- ``dead``: after a first allreduce, rank 1's stream is slowed down and rank 1 ends abruptly while the second
  allreduce's NCCL call is queued: rank 0 raises (NCCL's remote error), nobody hangs.
- ``nccl_error``: rank 1's second ncclAllReduce fails (injected ncclSystemError): both raise.
- ``oom``: rank 1's GPU is too small for the fusion buffer of a fused allreduce: both raise.
- ``handed_back``: both ranks' streams are slowed down (100 ms an item), then an async allreduce: prints whether
  its handle completed before its work ran (the device memory still held the input when ``poll`` first said
  done: ``early True`` with RVOD_ENABLE_ASYNC_COMPLETION, ``early False`` without), then the result once waited
  for, then a second allreduce's result (the in-flight list emptied and the communicator went on).
- ``handed_back_dead``: as ``dead``, with RVOD_ENABLE_ASYNC_COMPLETION: the second allreduce is handed back before
  its work ran; rank 0's host wait for it raises once the loop found NCCL's error (and aborted, which ends the
  stuck work), and so does the next op.

Each rank prints ``first <values>`` (where it ran one), then ``result <values>`` lines or ``raised <class>:
<message>``, and ``finished``.
"""

import os
import sys
import threading

SCENARIO = os.environ["SCENARIO"]
RANK = int(os.environ.get("RVOD_RANK", "0"))
if SCENARIO == "nccl_error" and RANK == 1:
    os.environ["RVOD_STANDIN_FAIL"] = "ncclAllReduce:2:2:injected: NET/Socket connection closed"
if SCENARIO == "oom" and RANK == 1:
    os.environ["RVOD_STANDIN_DEVICE_MEMORY"] = "256K"

import numpy as np  # noqa: E402

sys.path.insert(0, os.environ["STANDIN_DIR"])
import gpu_standin as g  # noqa: E402

import rvod.numpy as hvd  # noqa: E402

hvd.init()
rank = hvd.rank()
device = 0 if os.environ.get("GPU_OF_RANK", "own") == "same" else rank


def on_gpu(values):
    return g.DeviceArray(np.asarray(values, np.float32), device=device)


def read(result):
    return g.read_capsule(result.__dlpack__())[1].tolist()


def first():
    print("first", read(hvd.allreduce(on_gpu([1.0, 2.0]), op=hvd.Sum, name="first")), flush=True)


try:
    if SCENARIO == "join":
        first()
        if rank == 0:
            print("result", read(hvd.allreduce(on_gpu([3.0, 4.0]), op=hvd.Sum, name="single")), flush=True)
            a = on_gpu([5.0])
            hvd.allreduce_(a, op=hvd.Sum, name="in_place")
            print("result", a.to_numpy().tolist(), flush=True)
            b, c = on_gpu([6.0, 7.0]), on_gpu([8.0])
            hvd.grouped_allreduce_([b, c], op=hvd.Sum, name="fused")
            print("result", b.to_numpy().tolist(), c.to_numpy().tolist(), flush=True)
        print("last joined", hvd.join(), flush=True)
    elif SCENARIO == "join_first":
        if rank == 0:
            print("result", read(hvd.allreduce(on_gpu([3.0, 4.0]), op=hvd.Sum, name="single")), flush=True)
        print("last joined", hvd.join(), flush=True)
    elif SCENARIO == "plain":
        try:
            first()
        except Exception as error:  # noqa: BLE001 - the test reads the class and the message
            print(f"raised {type(error).__name__}: {error}", flush=True)
        print("cpu", hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="cpu").tolist(), flush=True)
    elif SCENARIO == "handed_back":
        import time

        a = on_gpu([1.0, 2.0])
        g.load().standin_set_stream_delay_us(100_000)
        handle = hvd.allreduce_async_(a, op=hvd.Sum, name="slow")
        deadline = time.monotonic() + 20
        while not hvd.poll(handle) and time.monotonic() < deadline:
            time.sleep(0.001)
        print("early", a.peek().tolist() == [1.0, 2.0], flush=True)
        hvd.synchronize(handle)
        print("result", a.to_numpy().tolist(), flush=True)
        g.load().standin_set_stream_delay_us(0)
        print("result", read(hvd.allreduce(on_gpu([5.0]), op=hvd.Sum, name="after")), flush=True)
    elif SCENARIO in ("dead", "handed_back_dead"):
        first()
        second = on_gpu([1.0, 1.0])
        if rank == 1:
            g.load().standin_set_stream_delay_us(10_000_000)  # the NCCL call waits in the stream meanwhile
            threading.Timer(1.0, lambda: os._exit(0)).start()
        try:
            hvd.allreduce(second, op=hvd.Sum, name="second")
            print("no error", flush=True)
        except Exception as error:  # noqa: BLE001 - the test reads the class and the message
            if SCENARIO == "dead":
                raise
            print(f"raised {type(error).__name__}: {error}", flush=True)
        hvd.allreduce(on_gpu([1.0]), op=hvd.Sum, name="third")
        print("no error", flush=True)
    elif SCENARIO == "nccl_error":
        first()
        hvd.allreduce(on_gpu([1.0, 1.0]), op=hvd.Sum, name="second")
        print("no error", flush=True)
    elif SCENARIO == "oom":
        first()
        arrays = [on_gpu(np.ones(20_000)), on_gpu(np.ones(20_000))]
        hvd.grouped_allreduce_(arrays, op=hvd.Sum, name="fused")
        print("no error", flush=True)
except Exception as error:  # noqa: BLE001 - the test reads the class and the message
    print(f"raised {type(error).__name__}: {error}", flush=True)
print("finished", flush=True)
if SCENARIO in ("join", "join_first", "plain", "handed_back"):
    hvd.shutdown()
os._exit(0)
