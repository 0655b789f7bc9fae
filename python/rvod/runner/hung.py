"""The elastic driver's watch for workers that are alive but make no progress (RVOD_ELASTIC_HUNG_TIMEOUT).

Every elastic worker beats (``rvod.common.elastic_worker``): it sets ``elastic/heartbeat/<worker>`` to a
count that grows, with, on a rank whose engine coordinates, the ranks its engine found hung. A worker is
hung when

- its count stopped growing for the hung time: the whole process is frozen (SIGSTOP, a debugger, C code
  holding the GIL). This also covers a frozen rank 0, which cannot report itself;
- a rank of the running world reports it: it has not submitted collectives the others have waited on for
  the hung time, and waits on none itself (blocked in the script: a sleep, a lock, a stuck data loader).

The driver kills a hung worker (SIGKILL ends a stopped process too) and handles it as one that failed.
Detection comes within the hung time plus about a second (a beat, a check, the coordinator's stall check).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

HEARTBEAT_KEY = "elastic/heartbeat/{worker}"


@dataclass(frozen=True)
class Hung:
    """A worker found hung, and why (a phrase: "made no progress for 5.0 s: ...")."""

    worker: int
    reason: str


def _parse(value: bytes | None) -> dict | None:
    if value is None:
        return None
    try:
        beat = json.loads(value)
    except ValueError:
        return None
    return beat if isinstance(beat, dict) and isinstance(beat.get("beat"), int) else None


class HungWatch:
    """Finds hung workers from their heartbeats, read every ``interval`` seconds."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.interval = min(0.5, timeout / 4)
        self._seen: dict[int, tuple[int, float]] = {}  # worker -> (its last count, when the driver saw it change)

    def check(self, beats: Mapping[int, bytes | None], world: int | None, ranks: Mapping[int, int],
              now: float) -> list[Hung]:
        """``beats``: worker id -> its heartbeat (None: none yet) for every worker watched (alive, not
        leaving); ``world``, ``ranks``: the running world and its rank -> worker id (None: none runs).
        A worker that never beat is not judged by its beats (it has not reached ``init()`` yet)."""
        found: dict[int, str] = {}
        self._seen = {worker: seen for worker, seen in self._seen.items() if worker in beats}
        workers_of = {worker: rank for rank, worker in ranks.items()}
        for worker, value in beats.items():
            beat = _parse(value)
            seen = self._seen.get(worker)
            if beat is not None and (seen is None or seen[0] != beat["beat"]):
                self._seen[worker] = (beat["beat"], now)
            elif seen is not None and now - seen[1] >= self.timeout:
                found.setdefault(worker, f"sent no heartbeat for {now - seen[1]:.1f} s (its process is stopped, "
                                         "frozen or cut off from the driver)")
            if beat is None or world is None or beat.get("round") != world:
                continue
            for report in beat.get("hung") or []:
                try:
                    rank, seconds, tensors = int(report[0]), float(report[1]), [str(t) for t in report[2]]
                except (TypeError, ValueError, IndexError):
                    continue
                if rank in ranks and ranks[rank] in beats:
                    found.setdefault(ranks[rank], f"made no progress for {seconds:.1f} s: it has not submitted "
                                                  f"[{', '.join(tensors)}], which the other ranks wait on "
                                                  f"(found by rank {workers_of.get(worker, '?')})")
        return [Hung(worker, reason) for worker, reason in found.items()]
