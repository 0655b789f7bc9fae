"""The environment one rank starts with: rvodrun's own, the job's settings, and the rank's identity.

Only RVOD_* names are set; the engine also reads HOROVOD_* aliases, but two spellings of the same
value would only invite disagreement. `rendezvous_env` (where the ranks meet) and `identity_env` (who this
rank is) are the two blocks `worker_env` adds; an mpirun launch sets the first in mpirun's environment
and the second in each rank (rvod.runner.mpi, rvod.runner.mpi_rank).
"""

from __future__ import annotations

from collections.abc import Mapping

from rvod.runner.hosts import Slot


def rendezvous_env(rendezvous_addr: str, rendezvous_port: int, secret: bytes) -> dict[str, str]:
    """What every rank of a job shares: where the rendezvous store is, the job's secret."""
    return {
        "RVOD_RENDEZVOUS_ADDR": rendezvous_addr,
        "RVOD_RENDEZVOUS_PORT": str(rendezvous_port),
        "RVOD_SECRET": secret.hex(),
        # Ranks' output goes through a pipe; without this Python would hold it back in block buffers.
        "PYTHONUNBUFFERED": "1",
    }


def identity_env(slot: Slot) -> dict[str, str]:
    """What tells a rank who it is: its rank, local rank and cross rank, and its host."""
    return {
        "RVOD_RANK": str(slot.rank),
        "RVOD_SIZE": str(slot.size),
        "RVOD_LOCAL_RANK": str(slot.local_rank),
        "RVOD_LOCAL_SIZE": str(slot.local_size),
        "RVOD_CROSS_RANK": str(slot.cross_rank),
        "RVOD_CROSS_SIZE": str(slot.cross_size),
        "RVOD_HOSTNAME": slot.hostname,
    }


def worker_env(
    base: Mapping[str, str],
    slot: Slot,
    *,
    rendezvous_addr: str,
    rendezvous_port: int,
    secret: bytes,
    settings: Mapping[str, str],
) -> dict[str, str]:
    """`base` plus the job-wide `settings` plus what tells this rank who it is and where to meet its peers."""
    env = dict(base)
    env.update(settings)
    env.update(identity_env(slot))
    env.update(rendezvous_env(rendezvous_addr, rendezvous_port, secret))
    return env
