"""The two implementations under test behind one small interface, so every measurement phase is written once.

`RvodBackend` drives rvod through its public NumPy API (`rvod.numpy`); `GlooBackend` drives
`torch.distributed` with the gloo backend. Buffers are float32 and come from `new_buffer` / `views`, so each
backend works on its own natural tensor type (NumPy arrays for rvod, torch CPU tensors for gloo) while the
memory behind them is allocated and touched the same way. Every rvod op carries a fixed name, so from the
second call on the engine's response cache serves it (unnamed ops would get a fresh name per call).
"""

import os
import time

import numpy as np


class RvodBackend:
    name = "rvod"

    def __init__(self):
        import rvod.numpy as hvd

        self.hvd = hvd
        hvd.init()
        self.rank = hvd.rank()
        self.size = hvd.size()

    def new_buffer(self, count):
        buf = np.empty(count, dtype=np.float32)
        buf.fill(0.0)  # fault every page in now, outside any timed region
        return buf

    def views(self, arena, count, k):
        return [arena[i * count:(i + 1) * count] for i in range(k)]

    def barrier(self):
        self.hvd.barrier()

    def allreduce_latency(self, buf, name):
        """The call a user makes for a small out-of-place sum."""
        return self.hvd.allreduce(buf, name=name, op=self.hvd.Sum)

    def allreduce_(self, buf, name):
        self.hvd.allreduce_(buf, name=name, op=self.hvd.Sum)

    def allgather(self, buf, out, name):
        # rvod (like Horovod) has no allgather into a caller's buffer: the result is a new array.
        return self.hvd.allgather(buf, name=name)

    def broadcast_(self, buf, name):
        self.hvd.broadcast_(buf, root_rank=0, name=name)

    def fused_step(self, tensors, names, variant):
        """Submit every tensor, then synchronize them all; returns the seconds spent submitting."""
        hvd = self.hvd
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
        submitted = time.perf_counter() - t0
        for h in handles:
            hvd.synchronize(h)
        return submitted

    fused_variants = ("async_then_synchronize",)

    def shutdown(self):
        self.hvd.shutdown()


class GlooBackend:
    name = "gloo"

    def __init__(self):
        import datetime

        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=300))
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def new_buffer(self, count):
        buf = self.torch.empty(count, dtype=self.torch.float32)
        buf.fill_(0.0)
        return buf

    def views(self, arena, count, k):
        return [arena[i * count:(i + 1) * count] for i in range(k)]

    def barrier(self):
        self.dist.barrier()

    def allreduce_latency(self, buf, name):
        self.dist.all_reduce(buf)

    def allreduce_(self, buf, name):
        self.dist.all_reduce(buf)

    def allgather(self, buf, out, name):
        self.dist.all_gather_into_tensor(out, buf)

    def broadcast_(self, buf, name):
        self.dist.broadcast(buf, src=0)

    def fused_step(self, tensors, names, variant):
        dist = self.dist
        if variant == "one_by_one":
            for t in tensors:
                dist.all_reduce(t)
        else:
            t0 = time.perf_counter()
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            submitted = time.perf_counter() - t0
            for w in works:
                w.wait()
            return submitted
        return None

    fused_variants = ("one_by_one", "async_then_wait")

    def shutdown(self):
        self.dist.destroy_process_group()


def make_backend(impl):
    return {"rvod": RvodBackend, "gloo": GlooBackend}[impl]()
