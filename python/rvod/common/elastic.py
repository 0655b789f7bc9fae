"""Elastic training, framework-neutral: the state a script commits, and the loop that resets the job.

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
  for one exits with status 0.

Invariants: ranks of every world are dense (0..size-1) and the ranks that carried the committed state come
first, so rank 0, whose state ``sync()`` broadcasts, always holds the last commit. A worker only ever moves
to a newer world. ``HostsUpdatedInterrupt`` is raised on every rank at the same ``check_host_updates()``
(rank 0's view of the latest world is broadcast), so no rank is left in a collective the others skipped.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time

from rvod.exceptions import HostsUpdatedInterrupt, RvodInternalError, RvodMismatchError

WORKER_ID = "RVOD_ELASTIC_WORKER_ID"
ROUND = "RVOD_ELASTIC_ROUND"
TIMEOUT = "RVOD_ELASTIC_TIMEOUT"
_POLL_SECONDS = 0.02
# The topology variables a world assignment sets before init() reads them (see src/config.rs).
_ASSIGNED = {"rank": "RVOD_RANK", "size": "RVOD_SIZE", "local_rank": "RVOD_LOCAL_RANK",
             "local_size": "RVOD_LOCAL_SIZE", "cross_rank": "RVOD_CROSS_RANK", "cross_size": "RVOD_CROSS_SIZE",
             "hostname": "RVOD_HOSTNAME"}


def in_elastic_job() -> bool:
    """True in a worker that an elastic rvodrun started."""
    return bool(os.environ.get(WORKER_ID))


class _DriverLink:
    """This worker's connection to the elastic driver, through the rendezvous store."""

    def __init__(self):
        from rvod import _rvod

        self.worker = os.environ[WORKER_ID]
        self.round = int(os.environ.get(ROUND, "0"))
        self.timeout = float(os.environ.get(TIMEOUT, "600"))
        self._want_newer = False
        self._store = _rvod.StoreClient(os.environ["RVOD_RENDEZVOUS_ADDR"], int(os.environ["RVOD_RENDEZVOUS_PORT"]),
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
            print(f"rvod elastic: worker {self.worker}: the job finished training while this worker waited for a "
                  "new world; exiting", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(0)  # the engine is shut down already; the script's own exit would try to train on

    def wait_for_newer_round(self) -> None:
        """Blocks until the driver has formed a world newer than this worker's."""
        deadline = time.monotonic() + self.timeout
        while self.latest_round() <= self.round:
            self._exit_if_finished()
            if time.monotonic() >= deadline:
                raise self._deadline_error(f"no world newer than {self.round} was formed")
            time.sleep(_POLL_SECONDS)
        self.round = self.latest_round()

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
            assignment = self._store.get(f"elastic/round/{round_}/assign/{self.worker}", self.timeout)
            place = json.loads(assignment)
            if place.get("leave"):
                print(f"rvod elastic: worker {self.worker} has no place in the new world {round_} "
                      "(its host was removed or blacklisted); exiting", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(0)  # the engine is shut down already; the script's own exit would try to train on
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


class State:
    """State that is committed, restored and synchronised across the ranks of an elastic job.

    ``bcast_object(obj, root_rank, name)`` and ``get_rank()`` may come from the framework shim; by default
    they are rvod.common's ``broadcast_object`` and ``rank``.
    """

    def __init__(self, bcast_object=None, get_rank=None):
        if bcast_object is None or get_rank is None:
            from rvod.common import basics, objects

            bcast_object = bcast_object or objects.broadcast_object
            get_rank = get_rank or basics.rank
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (without arguments) after every reset, e.g. to scale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Horovod's notification hook; rvod's workers learn of host changes by asking the driver instead."""

    def commit(self):
        """Saves the state (what ``restore()`` returns to), then raises HostsUpdatedInterrupt if the hosts
        changed since the last check."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank when the driver formed a new world since this one
        started (``skip_sync`` when hosts were only removed). Every rank raises at the same call: rank 0's
        view is broadcast."""
        if not in_elastic_job():
            return
        link = driver_link()
        latest = link.latest_round() if self._rank() == 0 else None
        latest = self._bcast_object(latest, 0, "elastic.check_host_updates")
        if latest is not None and latest > link.round:
            causes = link.causes(link.round, latest)
            raise HostsUpdatedInterrupt(skip_sync=causes == {"removed"})

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """Called after the world changed; subclasses update what depends on the world (samplers)."""


class ObjectState(State):
    """State made of plain Python objects given as keyword arguments, reachable as attributes
    (``hvd.elastic.ObjectState(epoch=0, batch=0)``)."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        # Copies, so that changing a value in place (``state.counter += ...``) leaves the commit alone.
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0, "elastic.object_state")
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))



def reset_engine(shutdown, init):
    """The reset of every shim: stop this rank's engine, then start it in the next world."""
    shutdown()
    init()


def run_fn(func, reset, wrapping_errors=()):
    """Wraps ``func(state, ...)``: synchronise the state, run; on RvodInternalError restore the last commit
    and reset; on HostsUpdatedInterrupt reset without restoring (and skip the sync when hosts were only
    removed). ``reset()`` shuts the engine down and starts it in the next world. ``wrapping_errors``: a
    framework's exception types that carry an RvodInternalError raised inside its compiled code (TensorFlow
    turns one raised in a ``tf.function`` into a ``tf.errors.OpError`` naming it); they count as one.
    Anything else, RvodMismatchError included (a bug in the script), is not retried."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            except Exception as error:
                if not (isinstance(error, RvodInternalError) or _carries_internal_error(error, wrapping_errors)):
                    raise
                state.restore()
                skip_sync = False
                if in_elastic_job():
                    driver_link().request_reset()
            reset_until_running(reset)
            state.on_reset()

    return wrapper


def _carries_internal_error(error, wrapping_errors) -> bool:
    if not wrapping_errors or not isinstance(error, tuple(wrapping_errors)) or isinstance(error, RvodMismatchError):
        return False
    text = str(error)
    return any(name in text for name in ("RvodInternalError", "RvodTimeoutError"))


def reset_until_running(reset):
    """``reset()`` until the engine runs in a new world: a world that fails to start (a worker died while
    it formed) is left for the next one the driver forms."""
    while True:
        try:
            reset()
            return
        except RvodInternalError as error:
            if not in_elastic_job():
                raise
            print(f"rvod elastic: world {driver_link().round} failed to start ({error}); waiting for the next",
                  file=sys.stderr, flush=True)
            driver_link().request_reset()
