"""The job's rendezvous store: the authenticated key-value server every rank registers with.

It runs inside rvodrun for the life of the job. The native server is imported only when a job starts,
so the rest of the runner (and --help, --check-build) works before the extension is built.
"""

from __future__ import annotations

from typing import Protocol

LOOPBACK = "127.0.0.1"


class StoreUnavailable(RuntimeError):
    """The native extension that provides the store cannot be loaded."""


class RendezvousStore(Protocol):
    @property
    def port(self) -> int: ...

    def close(self) -> None: ...


def start_store(host: str, secret: bytes) -> RendezvousStore:
    """Starts a store listening on `host` at a free port, accepting only peers that know `secret`."""
    try:
        from rvod._rvod import RendezvousServer
    except ImportError as error:
        raise StoreUnavailable(
            f"cannot start the rendezvous store: the native extension rvod._rvod is not available ({error}); "
            "build it with `maturin develop` or install an rvod wheel"
        ) from error
    return RendezvousServer(host, 0, secret)
