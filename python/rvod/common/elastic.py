"""Elastic training, framework-neutral: the state a script commits, and the loop that resets the job.

A worker follows the driver protocol of ``rvod.common.elastic_worker``. Invariants: ranks of every world
are dense (0..size-1) and the ranks that carried the committed state come first, so rank 0, whose state
``sync()`` broadcasts, always holds the last commit. A worker only ever moves to a newer world.
``HostsUpdatedInterrupt`` is raised on every rank at the same ``check_host_updates()`` (rank 0's view of
the latest world is broadcast), so no rank is left in a collective the others skipped.
"""

from __future__ import annotations

import copy
import functools
import sys

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
