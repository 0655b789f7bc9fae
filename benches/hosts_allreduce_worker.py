"""One rank of the two-host allreduce benchmark (see hosts_allreduce.py): times in-place float32 allreduces of
every size in argv's plan with rvod (rvod.numpy; its environment says hierarchical or flat) or with
torch.distributed's gloo, and rank 0 prints one JSON line: {size_bytes: seconds per call}.

    python hosts_allreduce_worker.py rvod|gloo '{"sizes": [...], "budget": bytes, "min": k, "max": k}'
"""

import json
import os
import sys
import time

import numpy as np


def iterations(size, plan):
    return max(plan["min"], min(plan["max"], plan["budget"] // max(size, 1)))


def main():
    impl, plan = sys.argv[1], json.loads(sys.argv[2])
    if impl == "rvod":
        import rvod.numpy as hvd

        hvd.init()
        rank = hvd.rank()

        def allreduce(buf, name):
            hvd.allreduce_(buf, op=hvd.Sum, name=name)

        def barrier():
            hvd.allreduce(np.zeros(1, np.float32), name="barrier")

        finish = hvd.shutdown
    else:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def allreduce(buf, name):
            dist.all_reduce(buf)

        def barrier():
            dist.barrier()

        finish = dist.destroy_process_group
    seconds = {}
    for size in plan["sizes"]:
        count = max(1, size // 4)
        buf = np.zeros(count, np.float32) if impl == "rvod" else torch.zeros(count, dtype=torch.float32)
        name = f"size{size}"
        allreduce(buf, name)
        barrier()
        k = iterations(size, plan)
        start = time.perf_counter()
        for _ in range(k):
            allreduce(buf, name)
        seconds[size] = (time.perf_counter() - start) / k
        del buf
    barrier()
    if rank == 0:
        print(json.dumps({"impl": impl, "hierarchical": os.environ.get("RVOD_HIERARCHICAL_ALLREDUCE"),
                          "seconds": seconds}), flush=True)
    finish()


if __name__ == "__main__":
    main()
