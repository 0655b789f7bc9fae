"""How often an op on a tensor the engine refuses as it is crosses the native boundary (see
test_refusals.py): rank 0 prints, per op, the native calls rvod.common.ops made and what each returned."""

import json

import numpy as np
import torch

import rvod.numpy as hvd
import rvod.torch as th
from rvod.common import ops

hvd.init()
calls = []


def counted(name):
    native = getattr(ops, name)

    def call(*args):
        try:
            result = native(*args)
        except Exception as error:
            calls.append(type(error).__name__)
            raise
        calls.append("refused" if result is NotImplemented else type(result).__name__)
        return result

    setattr(ops, name, call)


counted("_submit_native")  # the one native entry of every op

big_endian = np.arange(4, dtype=">f4")  # the engine takes native byte order only; export() converts it
ops_to_run = {
    "numpy allreduce": lambda: hvd.allreduce(big_endian, op=hvd.Sum),
    "numpy broadcast": lambda: hvd.broadcast(big_endian, 0),
    "numpy allgather": lambda: hvd.allgather(big_endian),
    "numpy allreduce_async": lambda: hvd.synchronize(hvd.allreduce_async(big_endian, op=hvd.Sum)),
    "torch allreduce": lambda: th.allreduce(torch.from_numpy(big_endian.astype("<f4"))[::2], op=th.Sum),
}
seen = {}
for label, run in ops_to_run.items():
    calls.clear()
    result = run()
    seen[label] = {"calls": list(calls), "values": np.asarray(result, dtype=np.float64).tolist()}
if hvd.rank() == 0:
    print("CROSSINGS " + json.dumps(seen), flush=True)
hvd.shutdown()
