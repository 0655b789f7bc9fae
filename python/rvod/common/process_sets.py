"""Process sets: groups of ranks that collectives can run on, each negotiating on its own.

``global_process_set`` (id 0) holds every rank. Other sets are registered at ``init(process_sets=[...])``
or, when dynamic process sets are enabled, with ``add_process_set`` at run time; both are collective over
all ranks (every rank registers the same sets in the same order) and assign the same ids everywhere.
"""

from rvod import _rvod
from rvod.exceptions import RvodInvalidArgumentError

# What every call that needs the engine raises (as a ValueError) before init().
NOT_INITIALIZED = "rvod has not been initialized; use hvd.init()."


def _my_rank():
    """This process's global rank; ValueError before init()."""
    if not _rvod.is_initialized():
        raise ValueError(NOT_INITIALIZED)
    return _rvod.topology()[0]


class ProcessSet:
    """A set of ranks. ``ranks`` is kept sorted; ``process_set_id`` is None until registered. Two sets
    with the same ranks compare equal."""

    def __init__(self, ranks_or_comm):
        if hasattr(ranks_or_comm, "Get_rank"):
            raise NotImplementedError("process sets from MPI communicators need an MPI build; pass a list of ranks")
        ranks = [int(r) for r in ranks_or_comm]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"process set ranks must be distinct, got {ranks}")
        self.ranks = sorted(ranks)
        self.process_set_id = None
        self.mpi_comm = None

    def size(self):
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This process's rank within the set."""
        me = _my_rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self):
        return _my_rank() in self.ranks

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self):
        return hash(tuple(self.ranks))

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

# Registered sets by id (the global set included once init() ran).
_registered = {}


def _dynamic_enabled():
    """Whether the running engine allows adding and removing sets (RVOD_DYNAMIC_PROCESS_SETS, read by the
    engine's configuration, or ``init(process_sets="dynamic")``); raises when not initialized."""
    return _rvod.dynamic_process_sets()


def static_sets_for_init(process_sets):
    """Validate ``init(process_sets=...)`` and return the sets to register (duplicates refused); ``"dynamic"``
    registers none (it turns dynamic process sets on for this init, see ``basics.init``)."""
    if process_sets is None or process_sets == "dynamic":
        return []
    sets = list(process_sets)
    seen = {}
    for ps in sets:
        if not isinstance(ps, ProcessSet):
            raise TypeError(f"process_sets must contain ProcessSet objects, got {type(ps).__name__}")
        if ps.process_set_id is not None and ps.process_set_id != 0:
            raise ValueError(f"{ps} is already registered")
        key = tuple(ps.ranks)
        if key in seen:
            raise ValueError(f"{ps} is a duplicate of {seen[key]}")
        seen[key] = ps
    return sets


def after_init(size, static_sets):
    """Record the ids the engine gave the global set and the static sets."""
    _registered.clear()
    global_process_set.ranks = list(range(size))
    _registered[0] = global_process_set
    ids = {tuple(ranks): set_id for set_id, ranks in _rvod.process_sets()}
    for ps in static_sets:
        ps.process_set_id = ids[tuple(ps.ranks)]
        _registered[ps.process_set_id] = ps


def after_shutdown():
    for set_id, ps in list(_registered.items()):
        if set_id != 0:
            ps.process_set_id = None
    _registered.clear()


def registered_process_set(process_set_id):
    """The registered set with this id, or None."""
    return _registered.get(process_set_id)


def process_set_id_of(process_set):
    """The engine id of a registered set this rank may run collectives on; raises otherwise."""
    if process_set is global_process_set and _rvod.is_initialized():
        return 0  # every rank belongs to the global set: the common case, decided without the topology
    set_id = registered_id(process_set)
    me = _rvod.topology()[0]
    if me not in process_set.ranks:
        raise RvodInvalidArgumentError(f"Rank {me} is not a member of the provided process set {process_set}.")
    return set_id


def registered_id(process_set):
    """The engine id of a registered set, whether or not this rank is a member; raises for anything else
    (for what wraps collectives and leaves the values of a rank outside the set as they are)."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if not _rvod.is_initialized():
        raise ValueError(NOT_INITIALIZED)
    set_id = process_set.process_set_id
    if set_id is None or _registered.get(set_id) is None:
        raise ValueError(
            f"{process_set}: Process set provided does not exist, or has not been registered; register the "
            "process set with init(process_sets=[...]) or add_process_set()."
        )
    return set_id


def add_process_set(process_set_or_ranks):
    """Register a process set at run time (all ranks call this in the same order); returns it."""
    if not _dynamic_enabled():
        raise ValueError(
            "Set RVOD_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1) to allow adding process sets "
            "after initialization."
        )
    ps = process_set_or_ranks if isinstance(process_set_or_ranks, ProcessSet) else ProcessSet(process_set_or_ranks)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    for registered in _registered.values():
        if registered.ranks == ps.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: {ps} has the same ranks as {registered}")
    ps.process_set_id = _rvod.add_process_set(ps.ranks)
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set):
    """Remove a registered set (all ranks call this); returns False for the global set or an unknown set.
    The object is invalidated (its ``process_set_id`` becomes None)."""
    if not _dynamic_enabled():
        raise ValueError("Set RVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after initialization.")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or _registered.get(set_id) is not process_set:
        return False
    removed = _rvod.remove_process_set(set_id)
    del _registered[set_id]
    process_set.process_set_id = None
    return removed
