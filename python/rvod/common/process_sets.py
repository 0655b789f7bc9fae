"""Process sets: named groups of ranks that collectives can run on.

Only the global set (id 0, every rank) exists in this version; ops check what they are given so that a
script using other sets fails clearly instead of running on the wrong ranks.
"""


class ProcessSet:
    """A set of ranks. ``ranks`` is kept sorted; ``process_set_id`` is None until registered."""

    def __init__(self, ranks):
        self.ranks = sorted(int(r) for r in ranks)
        self.process_set_id = None
        self.mpi_comm = None

    def size(self):
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        from rvod.common import basics

        me = basics.rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self):
        from rvod.common import basics

        return basics.rank() in self.ranks

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self):
        return hash(tuple(self.ranks))

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def check_process_set(process_set):
    """Raise ValueError unless ``process_set`` can be used by a collective on this rank."""
    if process_set is global_process_set or (
        isinstance(process_set, ProcessSet) and process_set.process_set_id == 0
    ):
        return
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    raise ValueError(
        f"{process_set} is not registered: only the global process set is supported by this version of rvod"
    )


def add_process_set(process_set_or_ranks):
    raise ValueError(
        "Set RVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after initialization "
        "(process sets other than the global one are not supported by this version of rvod)."
    )


def remove_process_set(process_set):
    """Remove a registered process set; the global set cannot be removed (returns False)."""
    return False
