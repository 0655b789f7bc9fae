"""Life cycle and topology: init, shutdown, rank, size and the capability probes Horovod scripts call."""

import atexit
import os

from rvod import _rvod
from rvod.common import elastic_worker as _elastic, naming, process_sets as _process_sets
from rvod.common.process_sets import NOT_INITIALIZED

# What every shim re-exports (``from rvod.common.basics import *``).
__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "straggler_report",
]

_topology = None
_atexit_registered = False
# Work rvod started on the user's behalf that the other ranks may still wait for (a sharded optimizer's
# parameter allgather): finished before this rank's engine stops, at shutdown() or at exit.
_finish_before_shutdown = []
# What the native module was built with (``*_built()`` below): the extension says, Python does not guess.
_BUILD = _rvod.build_info()


def init(comm=None, process_sets=None):
    """Start this rank's engine and connect to the other ranks (idempotent while running).

    ``comm`` follows Horovod: ``None`` (every rank of the job), an mpi4py communicator (the job is its
    ranks), or a list of ``MPI_COMM_WORLD`` ranks (the job is those ranks; only they call ``init``); the
    last two need mpi4py. ``process_sets`` is a list of ``ProcessSet`` to register now (every rank passes
    the same list), or ``"dynamic"`` to allow ``add_process_set``/``remove_process_set`` later.
    """
    global _topology, _atexit_registered
    if _rvod.is_initialized():
        return
    static_sets = _process_sets.static_sets_for_init(process_sets)
    if _elastic.in_elastic_job():
        _elastic.before_init()  # the rank and size are those of the world the elastic driver formed
    dynamic = isinstance(process_sets, str) and process_sets == "dynamic"
    _rvod.init([ps.ranks for ps in static_sets], _mpi_for_init(comm), dynamic_process_sets=dynamic)
    _topology = _rvod.topology()
    _process_sets.after_init(_topology[1], static_sets)
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True


def _mpi_for_init(comm):
    """``(rank, size, bcast)`` of the MPI communicator the job runs on, or None when MPI plays no part.

    Without ``comm``, a job Open MPI or MPICH/Intel MPI started uses ``MPI_COMM_WORLD`` when mpi4py is
    importable: rank 0 then sends the others its rendezvous address and a fresh secret over it. MPI carries
    nothing else; collectives run on rvod's own transports.
    """
    if comm is None:
        launched = _rvod.launcher()
        if launched is None or launched[0] not in ("openmpi", "pmi"):
            return None
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        comm = MPI.COMM_WORLD
        if (comm.Get_rank(), comm.Get_size()) != tuple(launched[1:]):
            return None  # mpi4py's MPI is not the one that started the job
    else:
        try:
            from mpi4py import MPI
        except ImportError as error:
            raise ValueError(
                "init(comm=...) takes an mpi4py communicator or a list of MPI_COMM_WORLD ranks, which needs "
                "mpi4py (pip install mpi4py); without comm, init() uses every rank of the job"
            ) from error
        if not isinstance(comm, MPI.Comm):
            comm = _world_subset(MPI, comm)
    return comm.Get_rank(), comm.Get_size(), lambda payload: comm.bcast(payload, root=0)


def _world_subset(MPI, ranks):
    """A communicator of the listed ``MPI_COMM_WORLD`` ranks (Horovod's ``init(comm=[...])``)."""
    try:
        ranks = sorted({int(r) for r in ranks})
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"init(comm=...) takes an mpi4py communicator or a list of ranks, not {type(ranks).__name__}") from error
    world = MPI.COMM_WORLD
    if not ranks or ranks[0] < 0 or ranks[-1] >= world.Get_size():
        raise ValueError(f"init(comm={ranks}): ranks must be in 0..{world.Get_size() - 1} (MPI_COMM_WORLD)")
    if world.Get_rank() not in ranks:
        raise ValueError(
            f"init(comm={ranks}): this process is rank {world.Get_rank()} of MPI_COMM_WORLD, which is not in the "
            "list; only the listed ranks may call init(comm=...)")
    return world.Create_group(world.Get_group().Incl(ranks))


def finish_before_shutdown(callback):
    """Have ``callback()`` run before this rank's engine stops (``shutdown()`` or the end of the process): it
    finishes a collective rvod started itself, which the other ranks may still wait for."""
    _finish_before_shutdown.append(callback)


def _finish_started_work():
    for callback in _finish_before_shutdown:
        try:
            callback()
        except Exception:  # noqa: BLE001 - the job already failed (a peer died): shutting down is all that is left
            pass


def shutdown():
    """Stop this rank's engine (the other ranks stop too). ``init()`` may be called again afterwards."""
    global _topology
    if _rvod.is_initialized():
        _finish_started_work()
    _rvod.shutdown()
    _topology = None
    _process_sets.after_shutdown()
    naming.reset()


def _shutdown_at_exit():
    """The process is ending without having called shutdown(): the other ranks are told it exited."""
    global _topology
    if _rvod.is_initialized():
        _finish_started_work()
    _rvod.shutdown(True)
    _topology = None


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
    """False: rvod runs no collective over MPI (under mpirun it only uses mpi4py, if present, to meet)."""
    return False


def mpi_built():
    """False: rvod is not built against an MPI library."""
    return bool(_BUILD["mpi"])


def gloo_enabled():
    return False


def gloo_built():
    return bool(_BUILD["gloo"])


def nccl_built():
    """The NCCL version code (``NCCL_VERSION_CODE``, e.g. 23007 for 2.30.7) of the libnccl this process
    found and loaded, 0 when none was found.

    rvod links no NCCL: on the first ask it looks at ``RVOD_NCCL_LIBRARY``, then the nvidia-nccl-cu12/cu13
    Python packages, then the system (``rvodrun --check-build`` says where). A non-zero value says NCCL
    is there, not that rvod runs GPU collectives: this version refuses GPU tensors (see README, GPU status).
    """
    return int(_rvod.gpu_libraries()["nccl_version"])


def ddl_built():
    return bool(_BUILD["ddl"])


def ccl_built():
    return bool(_BUILD["ccl"])


def cuda_built():
    """True when this process found and loaded a CUDA runtime library (libcudart), on the first ask; it
    says nothing of a driver or a device (``rvodrun --check-build`` does)."""
    return bool(_rvod.gpu_libraries()["cuda_runtime_version"])


def rocm_built():
    return bool(_BUILD["rocm"])


def start_timeline(file_path, mark_cycles=False):
    """Record a Chrome-trace timeline of every rank's collectives into ``file_path`` (switching files if
    one is open). Needs ``RVOD_TIMELINE`` (or ``HOROVOD_TIMELINE``) set at start, to a path or ``DYNAMIC``."""
    _topo()
    _rvod.start_timeline(os.fspath(file_path), bool(mark_cycles))


def stop_timeline():
    """Close the current timeline file; everything recorded so far is in it when this returns."""
    _topo()
    _rvod.stop_timeline()


def straggler_report(process_set=None):
    """How late each rank of ``process_set`` (default: every rank) announces the collectives every rank
    then runs, as this rank has seen it: ``{global rank: {"rounds": decisions it took part in, "times_last":
    how often it was last, "mean_lateness": seconds behind the first rank on average, "straggler": whether
    it is named the straggler now}}``. A rank is named while it was last in 8 of the last 10 decisions,
    at least 5 ms and a quarter of the time between decisions late on average; rank 0 of the set logs a
    warning when one is named, and the timeline marks it. Raises ``ValueError`` where this rank is not a
    member of the set."""
    from rvod.common.process_sets import global_process_set, registered_id

    process_set = global_process_set if process_set is None else process_set
    _topo()
    records = _rvod.straggler_report(registered_id(process_set))
    if records is None:
        raise ValueError(f"straggler_report(): this rank is not a member of {process_set}")
    return {
        rank: {"rounds": rounds, "times_last": times_last, "mean_lateness": mean, "straggler": named}
        for rank, rounds, times_last, mean, named in records
    }
