"""The compute service: where a compute job (tf.data service dispatchers and workers) and training jobs
meet, as Horovod's ``horovod.runner.common.service.compute_service``.

``ComputeService`` runs in the compute job's rank 0 for the life of that job. It is rvod's rendezvous store
(the authenticated key-value server rvodrun serves a job from) with a fresh secret, so only processes given
the secret (through the config file) can talk to it. ``ComputeClient`` is everyone's view of it: dispatchers
register their addresses, workers register with their dispatcher, training ranks wait for both, and one of
them asks for the shutdown the compute job waits for. Its keys:

- ``compute/dispatchers``, ``compute/workers_per_dispatcher``: the shape, set by the service at start;
- ``compute/dispatcher/<id>``: dispatcher ``id``'s address (``grpc://host:port``);
- ``compute/dispatcher/<id>/worker/<n>``: the ``n``-th worker of dispatcher ``id`` is serving;
- ``compute/shutdown``: set once; the compute job ends when it sees it.

Every wait has a timeout; a service that cannot be reached, or that goes away while a client waits, is a
``ComputeServiceError`` naming its address, never a hang. ``exit_if_lost`` watches the service for clients
that cannot be interrupted (tf.data's). Framework-free: the TensorFlow side is
``rvod.tensorflow.data.compute_service``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from rvod.exceptions import RvodError
from rvod.runner import network, store

LOOPBACK_NAME = "lo"
_SHAPE_TIMEOUT_SECONDS = 10.0
_SHUTDOWN_POLL_SECONDS = 1.0
_SLICE_SECONDS = 1.0
_WATCH_SLICE_SECONDS = 0.25


class ComputeServiceError(RvodError, RuntimeError):
    """The compute service cannot be reached, went away, or refused a request; the message says which."""


class ComputeServiceTimeout(ComputeServiceError, TimeoutError):
    """Something the compute service waited for (a dispatcher, its workers) did not register in time."""


def _dispatcher_key(dispatcher_id: int) -> str:
    return f"compute/dispatcher/{dispatcher_id}"


def _worker_key(dispatcher_id: int, slot: int) -> str:
    return f"compute/dispatcher/{dispatcher_id}/worker/{slot}"


_SHUTDOWN_KEY = "compute/shutdown"


class ComputeService:
    """Serves the compute service on loopback (or on the address of the first of ``nics``) until
    ``shutdown()``. ``addresses()`` is what clients need besides ``key``."""

    def __init__(self, dispatchers: int, workers_per_dispatcher: int, key: bytes, nics: Sequence[str] | None = None):
        if dispatchers <= 0:
            raise ValueError(f"The number of dispatchers must be larger than 0: {dispatchers}")
        if workers_per_dispatcher <= 0:
            raise ValueError(f"The number of workers per dispatcher must be larger than 0: {workers_per_dispatcher}")
        nic = nics[0] if nics else None
        host = network.interface_address(nic) if nic else network.LOOPBACK
        self._server = store.start_store(host, key)
        self._addresses = {nic or LOOPBACK_NAME: [(host, self._server.port)]}
        self._client = ComputeClient(self._addresses, key)
        self._client._set("compute/dispatchers", str(dispatchers))
        self._client._set("compute/workers_per_dispatcher", str(workers_per_dispatcher))

    def addresses(self) -> dict[str, list[tuple[str, int]]]:
        return {name: list(addrs) for name, addrs in self._addresses.items()}

    def shutdown(self) -> None:
        """Marks the service shut down (if no client did) and stops serving; idempotent."""
        if self._server is None:
            return
        try:
            self._client.shutdown()
        except ComputeServiceError:
            pass  # the store is gone already: nobody is left to tell
        finally:
            self._client.close()
            self._server.close()
            self._server = None


class ComputeClient:
    """A connection to the compute service at one of ``compute_addresses`` (``{nic: [(host, port), ...]}``, as
    ``ComputeService.addresses()`` gives), authenticated with ``key``. ``timeout`` bounds the connection;
    ``verbose`` is there for Horovod's signature (rvod logs through ``logging``)."""

    def __init__(self, compute_addresses: Mapping[str, Sequence[Sequence]], key: bytes, verbose: int = 1,
                 timeout: float = _SHAPE_TIMEOUT_SECONDS):
        from rvod._rvod import StoreClient

        self.verbose = verbose
        candidates = [(str(host), int(port)) for addrs in compute_addresses.values() for host, port in addrs]
        if not candidates:
            raise ValueError("the compute service config lists no addresses")
        failures = []
        for host, port in candidates:
            try:
                self._store = StoreClient(host, port, key, timeout / len(candidates))
                self.address = f"{host}:{port}"
                break
            except (RuntimeError, ValueError) as error:
                failures.append(f"{host}:{port}: {error}")
        else:
            raise ComputeServiceError(
                f"cannot reach the compute service within {timeout:g} s ({'; '.join(failures)}); is the compute job "
                f"(python -m rvod.tensorflow.data.compute_worker CONFIGFILE) running, and is this config file the "
                f"one it wrote?")
        self._shape: tuple[int, int] | None = None

    # The store's own errors name its address and key; these add what the key means.
    def _set(self, key: str, value: str) -> None:
        try:
            self._store.set(key, value.encode())
        except RuntimeError as error:
            raise ComputeServiceError(f"the compute service at {self.address} went away: {error}") from None

    def _get(self, key: str, timeout: float, waiting_for: str) -> str:
        found = self._try_get(key, timeout)
        if found is None:
            raise ComputeServiceTimeout(
                f"Timed out after {timeout:g} s waiting for {waiting_for} at the compute service {self.address}. "
                f"Try to find out what takes so long, or increase the timeout.")
        return found

    def _try_get(self, key: str, timeout: float) -> str | None:
        """The value of ``key``, or None when nobody set it within ``timeout`` seconds; asked in slices of at
        most a second, so Ctrl-C interrupts a long wait."""
        deadline = time.monotonic() + max(0.0, float(timeout))
        while True:
            left = deadline - time.monotonic()
            try:
                value = self._store.try_get(key, min(max(0.0, left), _SLICE_SECONDS))
            except RuntimeError as error:
                raise ComputeServiceError(f"the compute service at {self.address} went away: {error}") from None
            if value is not None:
                return value.decode()
            if left <= _SLICE_SECONDS:
                return None

    def shape(self) -> tuple[int, int]:
        """(dispatchers, workers per dispatcher) of the service."""
        if self._shape is None:
            dispatchers = int(self._get("compute/dispatchers", _SHAPE_TIMEOUT_SECONDS, "its shape"))
            per_dispatcher = int(self._get("compute/workers_per_dispatcher", _SHAPE_TIMEOUT_SECONDS, "its shape"))
            self._shape = (dispatchers, per_dispatcher)
        return self._shape

    def _check_dispatcher_id(self, dispatcher_id: int) -> None:
        dispatchers = self.shape()[0]
        if not 0 <= dispatcher_id < dispatchers:
            raise IndexError(f"Dispatcher id must be within [0..{dispatchers - 1}]: {dispatcher_id}")

    def register_dispatcher(self, dispatcher_id: int, dispatcher_address: str) -> None:
        self._check_dispatcher_id(dispatcher_id)
        known = self._try_get(_dispatcher_key(dispatcher_id), 0)
        if known is not None and known != dispatcher_address:
            raise ValueError(f"Dispatcher with id {dispatcher_id} has already been registered under different "
                             f"address {known}: {dispatcher_address}")
        self._set(_dispatcher_key(dispatcher_id), dispatcher_address)

    def wait_for_dispatcher_registration(self, dispatcher_id: int, timeout: float) -> str:
        self._check_dispatcher_id(dispatcher_id)
        return self._get(_dispatcher_key(dispatcher_id), timeout, f"dispatcher {dispatcher_id} to register")

    def register_worker_for_dispatcher(self, dispatcher_id: int, worker_id: int) -> None:
        """Worker ``worker_id`` (a compute rank) serves dispatcher ``dispatcher_id``."""
        self._check_dispatcher_id(dispatcher_id)
        self._set(_worker_key(dispatcher_id, worker_id % self.shape()[1]), str(worker_id))

    def wait_for_dispatcher_worker_registration(self, dispatcher_id: int, timeout: float) -> None:
        """Waits until every worker of the dispatcher registered; with one dispatcher, that one's."""
        self._check_dispatcher_id(dispatcher_id)
        dispatchers, per_dispatcher = self.shape()
        dispatcher_id = dispatcher_id if dispatchers > 1 else 0
        for slot in range(per_dispatcher):
            self._get(_worker_key(dispatcher_id, slot), timeout,
                      f"the workers for dispatcher {dispatcher_id} to register ({slot} of {per_dispatcher} did)")

    def shutdown(self) -> None:
        """Asks the compute job to stop its dispatchers and workers and end."""
        self._set(_SHUTDOWN_KEY, "1")

    def is_running(self) -> bool:
        """False once a shutdown was asked for (raises when the service itself is gone)."""
        return self._try_get(_SHUTDOWN_KEY, 0) is None

    def wait_for_shutdown(self) -> None:
        """Blocks until a shutdown is asked for; ``ComputeServiceError`` when the service goes away first."""
        while self._try_get(_SHUTDOWN_KEY, _SHUTDOWN_POLL_SECONDS) is None:
            pass

    def close(self) -> None:
        self._store.close()


_watched: dict[str, tuple[threading.Thread, threading.Event]] = {}
_watched_lock = threading.Lock()


def exit_if_lost(compute_addresses: Mapping[str, Sequence[Sequence]], key: bytes, timeout: float) -> None:
    """Starts (once per service and process) a thread that ends this process with exit status 1 and a message
    naming the service if the service goes away before a shutdown was asked for. For clients, such as
    tf.data's, that would otherwise wait for a dead service forever, in code Python cannot interrupt.
    The thread stops when the process exits (a thread left in native code then would abort it)."""
    service = json.dumps({nic: [list(addr) for addr in addrs] for nic, addrs in compute_addresses.items()},
                         sort_keys=True)
    with _watched_lock:
        if service in _watched:
            return
        if not _watched:
            atexit.register(_stop_watching)
        stop = threading.Event()
        watcher = ComputeClient(compute_addresses, key, timeout=timeout)
        thread = threading.Thread(target=_exit_when_lost, args=(watcher, stop), name="rvod-compute-service-watchdog",
                                  daemon=True)
        _watched[service] = (thread, stop)
    thread.start()


def _exit_when_lost(watcher: ComputeClient, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            if watcher._try_get(_SHUTDOWN_KEY, _WATCH_SLICE_SECONDS) is not None:
                return
    except ComputeServiceError as error:
        print(f"rvod: the compute service at {watcher.address} went away before anyone asked it to shut down "
              f"(did the compute job die?); its tf.data clients would wait for it forever, so this process exits. "
              f"({error})", file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        watcher.close()


def _stop_watching() -> None:
    with _watched_lock:
        watching = list(_watched.values())
    for _, stop in watching:
        stop.set()
    for thread, _ in watching:
        thread.join(timeout=5 * _WATCH_SLICE_SECONDS)
