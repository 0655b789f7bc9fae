"""Life cycle and topology: init, shutdown, rank, size and the capability probes Horovod scripts call."""

import atexit

from rvod import _rvod
from rvod.common import naming
from rvod.common.process_sets import ProcessSet, global_process_set

_NOT_INITIALIZED = "rvod has not been initialized; use hvd.init()."
_topology = None
_atexit_registered = False


def init(comm=None, process_sets=None):
    """Start this rank's engine and connect to the other ranks (idempotent while running).

    ``comm`` and ``process_sets`` follow Horovod; only ``None`` (all ranks) is supported for ``comm``.
    """
    global _topology, _atexit_registered
    if comm is not None:
        raise ValueError("init(comm=...) needs an MPI build; rvod starts every rank with rvodrun instead")
    if process_sets not in (None, []):
        if process_sets == "dynamic":
            raise ValueError("dynamic process sets are not supported by this version of rvod")
        sets = list(process_sets)
        for ps in sets:
            if not isinstance(ps, ProcessSet):
                raise TypeError(f"process_sets must contain ProcessSet objects, got {type(ps).__name__}")
        raise ValueError("process sets other than the global one are not supported by this version of rvod")
    _rvod.init()
    _topology = _rvod.topology()
    global_process_set.ranks = list(range(_topology[1]))
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def shutdown():
    """Stop this rank's engine (the other ranks stop too). ``init()`` may be called again afterwards."""
    global _topology
    _rvod.shutdown()
    _topology = None
    naming.reset()


def is_initialized():
    return _rvod.is_initialized()


def _topo():
    if _topology is None or not _rvod.is_initialized():
        raise ValueError(_NOT_INITIALIZED)
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
    """Timeline recording is not in this version; this says so without failing the script."""
    _topo()
    import warnings

    warnings.warn("rvod: the timeline is not available in this version; start_timeline() does nothing", stacklevel=2)


def stop_timeline():
    """Counterpart of start_timeline(); does nothing in this version."""
    _topo()
