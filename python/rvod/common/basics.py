"""Life cycle and topology: init, shutdown, rank, size and the capability probes Horovod scripts call."""

import atexit
import os

from rvod import _rvod
from rvod.common import naming, process_sets as _process_sets

# What every shim re-exports (``from rvod.common.basics import *``).
__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
]

NOT_INITIALIZED = "rvod has not been initialized; use hvd.init()."
_topology = None
_atexit_registered = False


def init(comm=None, process_sets=None):
    """Start this rank's engine and connect to the other ranks (idempotent while running).

    ``comm`` follows Horovod; only ``None`` (all ranks) is supported. ``process_sets`` is a list of
    ``ProcessSet`` to register now (every rank passes the same list), or ``"dynamic"`` to allow
    ``add_process_set``/``remove_process_set`` later.
    """
    global _topology, _atexit_registered
    if comm is not None:
        raise ValueError("init(comm=...) needs an MPI build; rvod starts every rank with rvodrun instead")
    if _rvod.is_initialized():
        return
    static_sets = _process_sets.static_sets_for_init(process_sets)
    _rvod.init([ps.ranks for ps in static_sets])
    _topology = _rvod.topology()
    _process_sets.after_init(_topology[1], static_sets)
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def shutdown():
    """Stop this rank's engine (the other ranks stop too). ``init()`` may be called again afterwards."""
    global _topology
    _rvod.shutdown()
    _topology = None
    _process_sets.after_shutdown()
    naming.reset()


def is_initialized():
    return _rvod.is_initialized()


def _topo():
    if _topology is None or not _rvod.is_initialized():
        raise ValueError(NOT_INITIALIZED)
    return _topology


def rank():
    return _topo()[0]


def size():
    return _topo()[1]


def local_rank():
    return _topo()[2]


def local_size():
    return _topo()[3]


def cross_rank():
    return _topo()[4]


def cross_size():
    return _topo()[5]


def is_homogeneous():
    return _topo()[6]


def mpi_threads_supported():
    raise ValueError("MPI is not used by rvod; mpi_threads_supported() has no meaning here")


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return False


def gloo_built():
    return False


def nccl_built():
    """NCCL version code of the build, 0 when built without NCCL."""
    return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return False


def rocm_built():
    return False


def start_timeline(file_path, mark_cycles=False):
    """Record a Chrome-trace timeline of every rank's collectives into ``file_path`` (switching files if
    one is open). Needs ``RVOD_TIMELINE`` (or ``HOROVOD_TIMELINE``) set at start, to a path or ``DYNAMIC``."""
    _topo()
    _rvod.start_timeline(os.fspath(file_path), bool(mark_cycles))


def stop_timeline():
    """Close the current timeline file; everything recorded so far is in it when this returns."""
    _topo()
    _rvod.stop_timeline()
