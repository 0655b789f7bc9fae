"""Hosts, their slots, and where each rank of a job runs.

Ranks fill hosts in the order given, each host up to its slot count, as horovodrun does. A rank's
`local_rank` counts ranks on its host; its `cross_rank` is the index of its host among the hosts that
have a rank with the same `local_rank`, and `cross_size` is the number of such hosts.
Problems are reported as `ValueError` with a message fit for the user.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """Where one rank runs and its place in the job's topology."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _slot_count(text: str, host: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        slots = 0
    if slots < 1:
        raise ValueError(f"host {host!r}: slots must be a whole number of at least 1, got {text!r}")
    return slots


def _require_unique(hosts: list[Host], source: str) -> list[Host]:
    if not hosts:
        raise ValueError(f"{source} names no hosts")
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise ValueError(f"host {host.name!r} is listed more than once in {source}")
        seen.add(host.name)
    return hosts


def parse_hosts(text: str) -> list[Host]:
    """Parses -H/--hosts: comma-separated `host[:slots]` entries (one slot when the count is left out)."""
    hosts = []
    for entry in text.split(","):
        entry = entry.strip()
        name, colon, count = entry.partition(":")
        if not name:
            raise ValueError(f"-H/--hosts has an entry without a host name: {text!r}")
        hosts.append(Host(name, _slot_count(count, name) if colon else 1))
    return _require_unique(hosts, "-H/--hosts")


def parse_hostfile(path: str) -> list[Host]:
    """Parses a hostfile: one `host [slots=N]` per line; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read hostfile {path!r}: {error.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, start=1):
        fields = line.partition("#")[0].split()
        if not fields:
            continue
        name, *settings = fields
        slots = 1
        for setting in settings:
            key, equals, value = setting.partition("=")
            if key != "slots" or not equals:
                raise ValueError(f"hostfile {path!r} line {number}: expected 'slots=N', got {setting!r}")
            slots = _slot_count(value, name)
        hosts.append(Host(name, slots))
    return _require_unique(hosts, f"hostfile {path!r}")


def local_names() -> set[str]:
    """Names that mean this machine (compared case-insensitively)."""
    hostname = socket.gethostname().lower()
    return {"localhost", "127.0.0.1", hostname, hostname.partition(".")[0]}


def remote_hosts(hosts: list[Host]) -> list[str]:
    """The hosts that are not this machine."""
    local = local_names()
    return [host.name for host in hosts if host.name.lower() not in local]


def assign_slots(hosts: list[Host], num_proc: int) -> list[Slot]:
    """Places `num_proc` ranks on `hosts`, filling each host in order before the next."""
    if num_proc < 1:
        raise ValueError(f"-np must be at least 1, got {num_proc}")
    available = sum(host.slots for host in hosts)
    if num_proc > available:
        raise ValueError(f"-np {num_proc} is more than the {available} slots on the hosts given "
                         f"({', '.join(f'{host.name}:{host.slots}' for host in hosts)})")

    local_sizes = []
    unplaced = num_proc
    for host in hosts:
        local_sizes.append(min(host.slots, unplaced))
        unplaced -= local_sizes[-1]

    slots: list[Slot] = []
    for host_index, (host, local_size) in enumerate(zip(hosts, local_sizes, strict=True)):
        for local_rank in range(local_size):
            slots.append(Slot(
                hostname=host.name,
                rank=len(slots),
                size=num_proc,
                local_rank=local_rank,
                local_size=local_size,
                cross_rank=sum(1 for size in local_sizes[:host_index] if size > local_rank),
                cross_size=sum(1 for size in local_sizes if size > local_rank),
            ))
    return slots
