"""What rvod.ray and rvod.spark share: ranks placed by a cluster engine become an rvod job.

The engine (Ray, Spark) decides where each rank runs; this module turns "rank i runs on host h_i" into each
rank's topology (local ranks are the ranks of one host, in rank order; cross ranks as Horovod defines them),
gives rank 0's process the job's rendezvous store, builds the environment ``hvd.init()`` reads, and runs a
cloudpickled function, catching what it raised as text. The secret travels only through the engine's own
channels (actor arguments, task closures); the store accepts only peers that know it.
"""

from __future__ import annotations

import os
import secrets
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rvod.runner import store
from rvod.runner.hosts import Slot
from rvod.runner.worker_env import worker_env

SECRET_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def slots_for_hosts(hosts: Sequence[str]) -> list[Slot]:
    """The topology of ranks placed on ``hosts`` (``hosts[i]`` runs rank ``i``; ranks of a host need not be
    consecutive). A host's local ranks follow rank order; a host's place among the hosts follows its first rank."""
    order: list[str] = []
    ranks_of: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        if host not in ranks_of:
            order.append(host)
            ranks_of[host] = []
        ranks_of[host].append(rank)
    local_sizes = [len(ranks_of[host]) for host in order]
    slots = []
    for rank, host in enumerate(hosts):
        local_rank = ranks_of[host].index(rank)
        host_index = order.index(host)
        slots.append(Slot(
            hostname=host,
            rank=rank,
            size=len(hosts),
            local_rank=local_rank,
            local_size=len(ranks_of[host]),
            cross_rank=sum(1 for size in local_sizes[:host_index] if size > local_rank),
            cross_size=sum(1 for size in local_sizes if size > local_rank),
        ))
    return slots


def store_address(hosts: Sequence[str], rank0_address: str) -> str:
    """Where rank 0's store listens: loopback when every rank is on rank 0's host, else rank 0's address."""
    return store.LOOPBACK if len(set(hosts)) == 1 else rank0_address


class HostedStore:
    """Rank 0's rendezvous store, kept by the process that runs rank 0 for as long as it is needed."""

    def __init__(self, address: str, secret: bytes):
        self._server = store.start_store(address, secret)
        self.address = address

    @property
    def port(self) -> int:
        return self._server.port

    def close(self) -> None:
        self._server.close()


def rank_env(slot: Slot, *, address: str, port: int, secret: bytes,
             settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """The RVOD_* variables that tell ``hvd.init()`` in this rank who it is and where rank 0's store is."""
    return worker_env({}, slot, rendezvous_addr=address, rendezvous_port=port, secret=secret,
                      settings=dict(settings or {}))


def apply_env(env: Mapping[str, str]) -> None:
    """Put ``env`` into this process's environment (a worker of the engine, which runs one rank at a time)."""
    os.environ.update({str(name): str(value) for name, value in env.items()})


@dataclass(frozen=True)
class Failure:
    """How one rank failed, on which host. ``secondary``: it failed because another rank did (a collective
    broke)."""

    rank: int
    detail: str
    secondary: bool = False
    host: str = ""


def call(rank: int, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
    """``(True, fn(*args, **kwargs))``, or ``(False, Failure)`` with the traceback when it raised."""
    from rvod.exceptions import RvodInternalError

    try:
        return True, fn(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - whatever the function raised goes back to the caller
        return False, Failure(rank, f"rank {rank} raised:\n{traceback.format_exc()}",
                              secondary=isinstance(error, RvodInternalError), host=socket.gethostname())


def failure_message(where: str, failures: Sequence[Failure]) -> str:
    """The failure to show (the first that is not a consequence of another), naming the other failed ranks."""
    chosen = min(failures, key=lambda failure: failure.secondary)
    on = f" on {chosen.host}" if chosen.host else ""
    text = f"{where}: rank {chosen.rank}{on} failed: {chosen.detail}"
    others = sorted(failure.rank for failure in failures if failure is not chosen)
    if others:
        text += f"\n{where}: rank(s) {others} failed too"
    return text
