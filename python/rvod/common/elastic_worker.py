"""An elastic worker's side of the driver protocol: joining the world the driver formed, asking for a new one.

A worker of an elastic job (started by rvodrun with --min-np / --host-discovery-script) talks to the
driver through the job's rendezvous store (authenticated with the job's secret), under ``elastic/``:

- ``elastic/round``: the latest world the driver formed (an integer that only grows);
- ``elastic/round/<R>/cause``: why it formed it (``start``, ``failure``, ``added``, ``removed``);
- ``elastic/round/<R>/assign/<worker>``: this worker's place in world R (JSON with rank, size, local and
  cross ranks, host) or ``{"leave": true}`` when world R has no place for it;
- ``elastic/round/<R>/ready/<worker>``: set by a worker waiting to start world R; the driver sets
  ``elastic/round/<R>/go`` once every worker of R is ready, so ``init()`` meets peers that are all there;
- ``elastic/reset/<worker>/<R>``: a worker of world R whose collective failed asks for a new world;
- ``elastic/finished``: a worker finished training, so no new world will be formed; a worker still waiting
  for one exits with status 0;
- ``elastic/heartbeat/<worker>``: set by a native thread of every worker, from its first ``init()`` on, every
  quarter of RVOD_ELASTIC_HUNG_TIMEOUT (at most every second): JSON with ``beat`` (a count that grows) and,
  while its engine runs, ``round`` and ``hung``, the ranks its engine found hung as [rank, seconds, tensors]
  (``src/engine/heartbeat.rs``).
  The driver kills a worker whose count stops or that a rank of the running world names
  (``rvod.runner.hung``).

A worker that is a process of its own (rvodrun's) leaves by exiting with status 0; one that is not (a Ray
actor, after ``leave_by_raising()``) raises ``LeftTheJob`` out of ``init()`` and the function that called it.
"""

from __future__ import annotations

import json
import os
import sys
import time

from rvod import _rvod
from rvod.exceptions import RvodInternalError

WORKER_ID = "RVOD_ELASTIC_WORKER_ID"
ROUND = "RVOD_ELASTIC_ROUND"
TIMEOUT = "RVOD_ELASTIC_TIMEOUT"
_POLL_SECONDS = 0.02
_ASSIGNMENT_GRACE_SECONDS = 5.0
# The topology variables a world assignment sets before init() reads them (see src/config.rs).
_ASSIGNED = {"rank": "RVOD_RANK", "size": "RVOD_SIZE", "local_rank": "RVOD_LOCAL_RANK",
             "local_size": "RVOD_LOCAL_SIZE", "cross_rank": "RVOD_CROSS_RANK", "cross_size": "RVOD_CROSS_SIZE",
             "hostname": "RVOD_HOSTNAME"}


class LeftTheJob(BaseException):
    """This worker has no place in the job any more (its host was removed, or training finished while it
    waited for a new world). A BaseException, so that the training function's own handlers let it through."""


_leave_by_raising = False


def leave_by_raising() -> None:
    """Workers of this process leave by raising LeftTheJob instead of exiting the process."""
    global _leave_by_raising
    _leave_by_raising = True


def _leave(message: str) -> None:
    print(f"rvod elastic: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _leave_by_raising:
        raise LeftTheJob(message)
    os._exit(0)  # the engine is shut down already; the script's own exit would try to train on


def in_elastic_job() -> bool:
    """True in a worker that an elastic rvodrun started."""
    return bool(os.environ.get(WORKER_ID))


class _DriverLink:
    """This worker's connection to the elastic driver, through the rendezvous store."""

    def __init__(self):
        self.worker = os.environ[WORKER_ID]
        self.round = int(os.environ.get(ROUND, "0"))
        self.timeout = float(os.environ.get(TIMEOUT, "600"))
        self._want_newer = False
        self.announced: int | None = None  # the world check_host_updates() last told every rank of
        self._store = self._connect()
        hung_timeout = _rvod.elastic_hung_timeout(dict(os.environ))
        if hung_timeout is not None:
            # Set once now, before this worker can be in a world, then from a native thread (it beats while the
            # script holds the GIL; only a frozen process stops it).
            self._connect().start_heartbeat(f"elastic/heartbeat/{self.worker}", min(1.0, hung_timeout / 4))

    def _connect(self):
        return _rvod.StoreClient(os.environ["RVOD_RENDEZVOUS_ADDR"], int(os.environ["RVOD_RENDEZVOUS_PORT"]),
                                 bytes.fromhex(os.environ["RVOD_SECRET"]), self.timeout)

    def latest_round(self) -> int:
        value = self._store.try_get("elastic/round", 0)
        return int(value) if value is not None else 0

    def causes(self, after: int, upto: int) -> set[str]:
        found = set()
        for r in range(after + 1, upto + 1):
            value = self._store.try_get(f"elastic/round/{r}/cause", 0)
            found.add(value.decode() if value is not None else "failure")
        return found

    def has_place(self, round_: int) -> bool:
        """Whether this worker has a place in world ``round_`` (no assignment: it was told to leave before)."""
        assignment = self._store.try_get(f"elastic/round/{round_}/assign/{self.worker}", 0)
        return assignment is not None and not json.loads(assignment).get("leave")

    def request_reset(self) -> None:
        """Asks for a new world (this one failed); the next ``enter_world`` waits for it."""
        self._store.set(f"elastic/reset/{self.worker}/{self.round}", b"1")
        self._want_newer = True

    def _deadline_error(self, what: str) -> RvodInternalError:
        return RvodInternalError(
            f"elastic worker {self.worker}: {what} within {self.timeout:.0f} s (--elastic-timeout); the driver "
            "(rvodrun) is gone or could not form a new world")

    def _exit_if_finished(self) -> None:
        if self._store.try_get("elastic/finished", 0) is not None:
            _leave(f"worker {self.worker}: the job finished training while this worker waited for a new world; "
                   "exiting")

    def wait_for_newer_round(self) -> None:
        """Blocks until the driver has formed a world newer than this worker's."""
        deadline = time.monotonic() + self.timeout
        while self.latest_round() <= self.round:
            self._exit_if_finished()
            if time.monotonic() >= deadline:
                raise self._deadline_error(f"no world newer than {self.round} was formed")
            time.sleep(_POLL_SECONDS)
        self.round = self.latest_round()

    def _assignment(self, round_: int) -> bytes | None:
        """This worker's assignment in world ``round_``; None when the driver wrote none. The driver writes every
        running worker's assignment before it publishes the round, so none is there only for a worker it no
        longer counts; the short wait covers a store that answers out of order."""
        return self._store.try_get(f"elastic/round/{round_}/assign/{self.worker}", _ASSIGNMENT_GRACE_SECONDS)

    def enter_world(self) -> None:
        """Takes this worker's place in the latest world it was assigned to: waits until every worker of that
        world is ready (following the driver to a newer world if one is formed meanwhile) and sets the
        topology variables init() reads. A worker with no place in the world exits with status 0."""
        if self._want_newer:
            self.wait_for_newer_round()
            self._want_newer = False
        deadline = time.monotonic() + self.timeout
        while True:
            round_ = max(self.round, self.latest_round())
            self.round = round_
            assignment = self._assignment(round_)
            if assignment is None:
                if self.latest_round() > round_:
                    continue
                _leave(f"worker {self.worker} has no place in world {round_} (the driver no longer counts it); "
                       "exiting")
            place = json.loads(assignment)
            if place.get("leave"):
                _leave(f"worker {self.worker} has no place in the new world {round_} (its host was removed or "
                       "blacklisted); exiting")
            self._store.set(f"elastic/round/{round_}/ready/{self.worker}", b"1")
            while self._store.try_get(f"elastic/round/{round_}/go", 0.05) is None:
                if self.latest_round() > round_:
                    break
                self._exit_if_finished()
                if time.monotonic() >= deadline:
                    raise self._deadline_error(f"the workers of world {round_} did not all become ready")
            else:
                for key, name in _ASSIGNED.items():
                    os.environ[name] = str(place[key])
                os.environ[ROUND] = str(round_)
                return


_link: _DriverLink | None = None


def driver_link() -> _DriverLink:
    global _link
    if _link is None:
        _link = _DriverLink()
    return _link


def before_init() -> None:
    """Called by init() in an elastic worker: join the latest world the driver formed."""
    driver_link().enter_world()
