"""Elastic training, framework-neutral: the state a script commits, and the loop that resets the job.

A worker follows the driver protocol of ``rvod.common.elastic_worker``. Invariants: ranks of every world
are dense (0..size-1) and the ranks that carried the committed state come first, so rank 0, whose state
``sync()`` broadcasts, always holds the last commit. A worker only ever moves to a newer world.
``HostsUpdatedInterrupt`` is raised on every rank at the same ``check_host_updates()`` (rank 0's view of
the latest world is broadcast), so no rank is left in a collective the others skipped; the old world still
runs then, and ``hand_over()`` gives what leaving ranks hold to ranks that stay. Every rank of a new world,
old or just started, takes the same path into it: the ranks agree (one collective) whether any of them
needs ``sync()``; when none does (hosts were only removed) they all call ``relayout()`` instead.
"""

from __future__ import annotations

import copy
import functools
import sys

from rvod import _rvod
from rvod.common import basics, objects
from rvod.common.elastic_worker import driver_link, in_elastic_job
from rvod.exceptions import HostsUpdatedInterrupt, RvodInternalError, RvodMismatchError


class State:
    """State that is committed, restored and synchronised across the ranks of an elastic job.

    ``bcast_object(obj, root_rank, name)`` and ``get_rank()`` may come from the framework shim; by default
    they are rvod.common's ``broadcast_object`` and ``rank``.
    """

    def __init__(self, bcast_object=None, get_rank=None):
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
            link.announced = latest
            raise HostsUpdatedInterrupt(skip_sync=causes == {"removed"})

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def relayout(self):
        """In a new world that skips ``sync()`` (hosts were only removed, every rank carried the state), lay
        out again what depends on the world's size (a sharded optimizer's slices). Collective: every rank
        calls it. Nothing by default."""

    def hand_over(self, leaving):
        """On every rank of a world that is about to be replaced (HostsUpdatedInterrupt, the world still runs):
        keep what the next world needs from this rank on ranks that stay (``leaving``: this rank has no place
        in it). Collective. Nothing by default."""

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
    and reset; on HostsUpdatedInterrupt hand over what leaving ranks hold (``state.hand_over``) and reset
    without restoring. ``reset()`` shuts the engine down and starts it in the next world. In an elastic job
    the ranks of the new world agree whether to ``sync()``: yes when any of them asks (a rank that just
    started, or one whose world changed otherwise than by hosts removed), else every rank calls
    ``state.relayout()``. ``wrapping_errors``: a framework's exception types that carry an RvodInternalError
    raised inside its compiled code (TensorFlow turns one raised in a ``tf.function`` into a
    ``tf.errors.OpError`` naming it); they count as one. Anything else, RvodMismatchError included (a bug in
    the script), is not retried."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if _anyone_syncs(not skip_sync):
                    state.sync()
                else:
                    state.relayout()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
                try:
                    state.hand_over(_leaving())
                except Exception as error:
                    if not (isinstance(error, RvodInternalError) or _carries_internal_error(error, wrapping_errors)):
                        raise
                    _restore_for_new_world(state)  # a rank died as the world was to change: a failure
                    skip_sync = False
            except Exception as error:
                if not (isinstance(error, RvodInternalError) or _carries_internal_error(error, wrapping_errors)):
                    raise
                _restore_for_new_world(state)
                skip_sync = False
            reset_until_running(reset)
            _rvod.note_elastic_reset()
            state.on_reset()

    return wrapper


def _restore_for_new_world(state):
    state.restore()
    if in_elastic_job():
        driver_link().request_reset()


def _anyone_syncs(wanted: bool) -> bool:
    """Whether any rank of this world wants ``sync()`` (collective in an elastic job: a rank that just
    started always does, and its peers must take the same path)."""
    if not in_elastic_job():
        return wanted
    return any(objects.allgather_object(wanted, name="elastic.sync_wanted"))


def _leaving() -> bool:
    """Whether this worker has no place in the world the driver announced (HostsUpdatedInterrupt)."""
    if not in_elastic_job():
        return False
    link = driver_link()
    return link.announced is not None and not link.has_place(link.announced)


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
