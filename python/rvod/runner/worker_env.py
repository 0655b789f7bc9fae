"""The environment one rank starts with: rvodrun's own, the job's settings, and the rank's identity.

Only RVOD_* names are set; the engine also reads HOROVOD_* aliases, but two spellings of the same
value would only invite disagreement.
"""

from __future__ import annotations

from collections.abc import Mapping

from rvod.runner.hosts import Slot


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
    env.update({
        "RVOD_RANK": str(slot.rank),
        "RVOD_SIZE": str(slot.size),
        "RVOD_LOCAL_RANK": str(slot.local_rank),
        "RVOD_LOCAL_SIZE": str(slot.local_size),
        "RVOD_CROSS_RANK": str(slot.cross_rank),
        "RVOD_CROSS_SIZE": str(slot.cross_size),
        "RVOD_HOSTNAME": slot.hostname,
        "RVOD_RENDEZVOUS_ADDR": rendezvous_addr,
        "RVOD_RENDEZVOUS_PORT": str(rendezvous_port),
        "RVOD_SECRET": secret.hex(),
        # Ranks' output goes through a pipe; without this Python would hold it back in block buffers.
        "PYTHONUNBUFFERED": "1",
    })
    return env
