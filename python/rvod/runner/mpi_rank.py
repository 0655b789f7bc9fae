"""`python -m rvod.runner.mpi_rank COMMAND...`: one rank of an `rvodrun --mpi` job, started by mpirun.

Open MPI says which rank this is (OMPI_COMM_WORLD_RANK, or PMI_RANK for MPICH-style launchers); rvodrun's
layout (RVOD_MPI_LAYOUT, `host:count,...` in placement order) says where every rank runs, so this rank's
local and cross ranks are the ones rvodrun would give it. The rank's RVOD_* identity (rvod.runner.worker_env)
is set and COMMAND replaces this process.
"""

from __future__ import annotations

import os
import sys

from rvod.runner.hosts import assign_slots
from rvod.runner.mpi import LAYOUT_VARIABLE, layout_hosts
from rvod.runner.worker_env import identity_env


def main(command: list[str]) -> None:
    if not command:
        sys.exit("rvod.runner.mpi_rank: no command given")
    rank_text = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
    if rank_text is None:
        sys.exit("rvod.runner.mpi_rank: not started by mpirun (no OMPI_COMM_WORLD_RANK or PMI_RANK)")
    hosts = layout_hosts(os.environ[LAYOUT_VARIABLE])
    slot = assign_slots(hosts, sum(host.slots for host in hosts))[int(rank_text)]
    env = dict(os.environ)
    env.update(identity_env(slot))
    try:
        os.execvpe(command[0], command, env)
    except OSError as error:
        sys.exit(f"rvodrun: cannot start rank {slot.rank} ({command[0]}): {error}")


if __name__ == "__main__":
    main(sys.argv[1:])
