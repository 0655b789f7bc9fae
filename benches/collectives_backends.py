"""The implementations under test behind one small interface, so every measurement phase is written once.

- `rvod-shm`, `rvod-tcp`: rvod through its public NumPy API (`rvod.numpy`), started by `rvodrun` with
  RVOD_SHM=1 / RVOD_SHM=0; the backend checks that `rvod._rvod.transport_kind()` is the transport the
  implementation claims, so a fallback cannot pass TCP numbers off as shared memory. The small-latency phase
  also times `rvod.torch.allreduce` on a torch tensor (`torch_allreduce`), the call a PyTorch user makes, and
  the many-small-tensors step has a third way through `rvod.torch` (`torch_async_then_synchronize`: the same
  buffers viewed as torch tensors), where torch is installed.
- `gloo`: `torch.distributed` with the gloo backend.
- `horovod`: `horovod.torch` on torch CPU tensors, started by `horovodrun` (only where Horovod is importable).
- `mpi`: MPI itself through mpi4py on NumPy arrays (`Allreduce`, `Iallreduce` + `Waitall`, `Allgather`, `Bcast`,
  `Barrier`), started by Open MPI's `mpirun` (only where mpi4py and mpirun are installed): the peer a CPU user
  would pick instead of rvod.

Out of place (`allreduce_out`) is the call each API offers for a result in new memory: the Horovod API's
`allreduce(x)`, gloo's `all_reduce` of `x.clone()`, MPI's `Allreduce(x, out)` into a fresh `np.empty_like(x)`.

rvod and Horovod share one class (`HorovodApiBackend`): the same calls, on NumPy arrays or torch tensors.
Buffers are float32 and come from `new_buffer` (NumPy for rvod, torch for the others), allocated and touched
the same way for everyone.
Every Horovod-API op carries a fixed name, so from the second call on the response cache serves it.
"""

import importlib.util
import os
import time

# The implementations a job can run: which backend class, and for rvod the transport it must end up on.
IMPLS = {
    "rvod-shm": ("rvod", "shm"),
    "rvod-tcp": ("rvod", "tcp"),
    "gloo": ("gloo", None),
    "horovod": ("horovod", None),
    "mpi": ("mpi", None),
}


def _torch_buffer(torch, count):
    buf = torch.empty(count, dtype=torch.float32)
    buf.fill_(0.0)  # fault every page in now, outside any timed region
    return buf


class HorovodApiBackend:
    """The Horovod API (`allreduce_`, `allreduce_async_` + `synchronize`, `grouped_allreduce_`, ...)."""

    tensors = None  # "numpy" or "torch": what this implementation's buffers are
    fused_variants = ("async_then_synchronize", "grouped")

    def __init__(self, name, hvd):
        self.name = name
        self.hvd = hvd
        hvd.init()
        self.rank = hvd.rank()
        self.size = hvd.size()

    def barrier(self):
        self.hvd.barrier()

    def allreduce_latency(self, buf, name):
        """The call a user makes for a small out-of-place sum."""
        return self.hvd.allreduce(buf, name=name, op=self.hvd.Sum)

    def allreduce_(self, buf, name):
        self.hvd.allreduce_(buf, name=name, op=self.hvd.Sum)

    def allreduce_out(self, buf, name):
        return self.hvd.allreduce(buf, name=name, op=self.hvd.Sum)

    def allgather(self, buf, out, name):
        # The Horovod API has no allgather into a caller's buffer: the result is a new tensor.
        return self.hvd.allgather(buf, name=name)

    def allgather_latency(self, buf, name):
        """The call a user makes for a small allgather (a result in new memory)."""
        return self.hvd.allgather(buf, name=name)

    def broadcast_(self, buf, name):
        self.hvd.broadcast_(buf, root_rank=0, name=name)

    def fused_step(self, tensors, names, variant):
        """One step of many small in-place sums; returns the seconds spent submitting them.

        async_then_synchronize: `allreduce_async_` per tensor, then `synchronize` each handle.
        grouped: one `grouped_allreduce_async_(tensors)` then `synchronize`, which is exactly what
        `grouped_allreduce_(tensors)` does, split so the submit time can be reported.
        """
        hvd = self.hvd
        t0 = time.perf_counter()
        if variant == "grouped":
            handles = [hvd.grouped_allreduce_async_(tensors, name=names[0] + ".grouped", op=hvd.Sum)]
        else:
            handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
        submitted = time.perf_counter() - t0
        for h in handles:
            hvd.synchronize(h)
        return submitted

    def shutdown(self):
        self.hvd.shutdown()


class RvodBackend(HorovodApiBackend):
    tensors = "numpy"
    fused_variants = HorovodApiBackend.fused_variants + (
        ("torch_async_then_synchronize",) if importlib.util.find_spec("torch") is not None else ())

    def __init__(self, name, expected_transport):
        import rvod._rvod
        import rvod.numpy as hvd

        super().__init__(name, hvd)
        self.transport = rvod._rvod.transport_kind(0)
        if self.size > 1 and self.transport != expected_transport:
            raise SystemExit(f"{name}: the job runs over {self.transport!r}, not {expected_transport!r} "
                             f"(RVOD_SHM={os.environ.get('RVOD_SHM')!r})")
        self._torch_hvd = None
        self._torch_views = None  # (the arrays, torch views of them) for the fused step's torch way

    def new_buffer(self, count):
        import numpy as np

        buf = np.empty(count, dtype=np.float32)
        buf.fill(0.0)  # fault every page in now, outside any timed region
        return buf

    def _torch(self):
        if self._torch_hvd is None:
            import rvod.torch

            self._torch_hvd = rvod.torch  # shares the engine rvod.numpy started
        return self._torch_hvd

    def torch_allreduce(self, buf, name):
        """`rvod.torch.allreduce` on a torch tensor: the small-allreduce call of a PyTorch training script."""
        hvd = self._torch()
        return hvd.allreduce(buf, name=name, op=hvd.Sum)

    def fused_step(self, tensors, names, variant):
        """The Horovod API's ways on NumPy arrays, and `torch_async_then_synchronize`: `rvod.torch`'s
        `allreduce_async_` per tensor then `synchronize`, on torch views of the same arrays (made once)."""
        if variant != "torch_async_then_synchronize":
            return super().fused_step(tensors, names, variant)
        hvd = self._torch()
        if self._torch_views is None or self._torch_views[0] is not tensors:
            import torch

            self._torch_views = (tensors, [torch.from_numpy(t) for t in tensors])
        views = self._torch_views[1]
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(views, names)]
        submitted = time.perf_counter() - t0
        for h in handles:
            hvd.synchronize(h)
        return submitted


class HorovodBackend(HorovodApiBackend):
    tensors = "torch"

    def __init__(self, name, expected_transport=None):
        import horovod.torch as hvd
        import torch

        self.torch = torch
        super().__init__(name, hvd)
        self.transport = "horovod-gloo" if hvd.gloo_enabled() else "horovod-mpi" if hvd.mpi_enabled() else "horovod"
        if not hasattr(hvd, "grouped_allreduce_async_"):  # Horovod < 0.21
            self.fused_variants = ("async_then_synchronize",)

    def new_buffer(self, count):
        return _torch_buffer(self.torch, count)


class GlooBackend:
    tensors = "torch"
    transport = "gloo-tcp"
    fused_variants = ("one_by_one", "async_then_wait")

    def __init__(self, name="gloo", expected_transport=None):
        import datetime

        import torch
        import torch.distributed as dist

        self.name = name
        self.torch = torch
        self.dist = dist
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=300))
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def new_buffer(self, count):
        return _torch_buffer(self.torch, count)

    def barrier(self):
        self.dist.barrier()

    def allreduce_latency(self, buf, name):
        self.dist.all_reduce(buf)

    def allreduce_(self, buf, name):
        self.dist.all_reduce(buf)

    def allreduce_out(self, buf, name):
        out = buf.clone()
        self.dist.all_reduce(out)
        return out

    def allgather(self, buf, out, name):
        self.dist.all_gather_into_tensor(out, buf)

    def allgather_latency(self, buf, name):
        out = buf.new_empty(self.size * buf.numel())
        self.dist.all_gather_into_tensor(out, buf)
        return out

    def broadcast_(self, buf, name):
        self.dist.broadcast(buf, src=0)

    def fused_step(self, tensors, names, variant):
        dist = self.dist
        if variant == "one_by_one":
            for t in tensors:
                dist.all_reduce(t)
            return None
        t0 = time.perf_counter()
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        submitted = time.perf_counter() - t0
        for w in works:
            w.wait()
        return submitted

    def shutdown(self):
        self.dist.destroy_process_group()


class MpiBackend:
    tensors = "numpy"
    transport = "mpi"
    fused_variants = ("iallreduce_then_waitall",)

    def __init__(self, name="mpi", expected_transport=None):
        import numpy as np
        from mpi4py import MPI

        self.name = name
        self.np = np
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def new_buffer(self, count):
        buf = self.np.empty(count, dtype=self.np.float32)
        buf.fill(0.0)  # fault every page in now, outside any timed region
        return buf

    def barrier(self):
        self.comm.Barrier()

    def allreduce_latency(self, buf, name):
        return self.allreduce_out(buf, name)

    def allreduce_(self, buf, name):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf)

    def allreduce_out(self, buf, name):
        out = self.np.empty_like(buf)
        self.comm.Allreduce(buf, out)
        return out

    def allgather(self, buf, out, name):
        self.comm.Allgather(buf, out)

    def allgather_latency(self, buf, name):
        out = self.np.empty(self.size * buf.size, buf.dtype)
        self.comm.Allgather(buf, out)
        return out

    def broadcast_(self, buf, name):
        self.comm.Bcast(buf, root=0)

    def fused_step(self, tensors, names, variant):
        t0 = time.perf_counter()
        requests = [self.comm.Iallreduce(self.MPI.IN_PLACE, t) for t in tensors]
        submitted = time.perf_counter() - t0
        self.MPI.Request.Waitall(requests)
        return submitted

    def shutdown(self):
        pass  # mpi4py finalizes MPI at exit


def make_backend(impl):
    family, transport = IMPLS[impl]
    cls = {"rvod": RvodBackend, "gloo": GlooBackend, "horovod": HorovodBackend, "mpi": MpiBackend}[family]
    return cls(impl, transport)
