"""Jobs started without rvodrun: the test process serves the rendezvous store and starts each rank itself.

rvodrun stops every rank as soon as one dies, and hides the store's port; tests that need the survivors of
a killed rank, or a stranger poking at the store, start the job with `LocalJob` instead. It gives each rank
the environment rvodrun would (RVOD_RANK ... RVOD_SECRET), starts ranks one at a time if asked, and writes
each rank's output to files so no pipe can fill up and stall a rank. `FakeHostsJob` gives each rank
rvodrun's environment for a `-H` host list whose names are only names, so the engine takes the ranks for
several hosts (shared memory inside each, TCP between them) on this one machine.

`HoldingRelay` sits between a rank and the store and holds back the request that carries a given key, so a
test can stop a rank at an exact point of its set-up. `StoreConnection` speaks the store's authentication
handshake (see src/transport/handshake.rs) from Python, so a test can play a stranger with the wrong secret,
or a legitimate client reading the mesh addresses.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import JOB_TAG_VARIABLE, kill_tagged

from rvod.runner.hosts import assign_slots, parse_hosts
from rvod.runner.worker_env import worker_env

WORKERS = Path(__file__).resolve().parent / "workers"
PYTHON = sys.executable

VERDICT = re.compile(r"^\[(\d+)\]<stdout>:rank (\d+): (\d+) checks passed, (\d+) failed$", re.MULTILINE)


def verdicts(stdout: str) -> dict[int, tuple[int, int]]:
    """rank -> (passed, failed) from the workers' last lines."""
    found = {}
    for match in VERDICT.finditer(stdout):
        prefix_rank, rank, passed, failed = map(int, match.groups())
        assert prefix_rank == rank, match.group(0)
        found[rank] = (passed, failed)
    return found


def failures(stderr: str) -> str:
    """rvodrun's stderr without the engine's warnings, leaving the workers' FAIL reports readable."""
    return "\n".join(line for line in stderr.splitlines() if "WARN" not in line)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FINAL_ACCURACY = re.compile(r"^\[0\]<stdout>:trained on 2 ranks in [\d.]+ s; test accuracy (\d\.\d+)$", re.MULTILINE)


def example_report(result: subprocess.CompletedProcess[str]) -> str:
    """What a failed example test shows: the exit code and the ends of the job's output."""
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{result.stderr[-5000:]}"


def assert_digits_example_succeeded(result: subprocess.CompletedProcess[str]) -> None:
    """A 2-rank digits example exited 0, only rank 0 printed, and its final test accuracy is above 0.9."""
    report = example_report(result)
    assert result.returncode == 0, report
    final = FINAL_ACCURACY.search(result.stdout)
    assert final and float(final.group(1)) > 0.9, report
    assert "[1]<stdout>:" not in result.stdout, "only rank 0 prints"


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


class LocalJob:
    """An n-rank job whose store runs in this process. Use as a context manager: leaving it kills whatever
    is still running and closes the store."""

    def __init__(self, job_env: dict[str, str], size: int, command: list[str], workdir: Path,
                 settings: dict[str, str] | None = None, secret: bytes | None = None):
        from rvod._rvod import RendezvousServer

        self.size = size
        self.command = command
        self.workdir = workdir
        self.secret = secret if secret is not None else os.urandom(16)
        self.store = RendezvousServer("127.0.0.1", 0, self.secret)
        self.port = self.store.port
        self.base_env = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_"))}
        self.base_env[JOB_TAG_VARIABLE] = job_env[JOB_TAG_VARIABLE]
        self.base_env.update(settings or {})
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    def env_for(self, rank: int) -> dict[str, str]:
        env = dict(self.base_env)
        env.update({
            "RVOD_RANK": str(rank),
            "RVOD_SIZE": str(self.size),
            "RVOD_LOCAL_RANK": str(rank),
            "RVOD_LOCAL_SIZE": str(self.size),
            "RVOD_CROSS_RANK": "0",
            "RVOD_CROSS_SIZE": "1",
            "RVOD_HOSTNAME": "localhost",
            "RVOD_RENDEZVOUS_ADDR": "127.0.0.1",
            "RVOD_RENDEZVOUS_PORT": str(self.port),
            "RVOD_SECRET": self.secret.hex(),
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def start(self, ranks=None, env: dict[str, str] | None = None) -> LocalJob:
        """Starts the given ranks (default: all); `env` overrides their environment (e.g. the store's port)."""
        for rank in range(self.size) if ranks is None else ranks:
            out = open(self.workdir / f"rank{rank}.out", "wb")
            err = open(self.workdir / f"rank{rank}.err", "wb")
            with out, err:
                self.processes[rank] = subprocess.Popen(self.command, env={**self.env_for(rank), **(env or {})},
                                                        stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        return self

    def output(self, rank: int) -> tuple[str, str]:
        read = lambda suffix: (self.workdir / f"rank{rank}.{suffix}").read_text(errors="replace")  # noqa: E731
        return read("out"), read("err")

    def wait(self, timeout: float, ranks=None) -> dict[int, RankResult]:
        """Waits for the given ranks (default: every started one); on timeout kills every rank and raises
        with their output so far."""
        deadline = time.monotonic() + timeout
        waited = {r: self.processes[r] for r in (self.processes if ranks is None else ranks)}
        for process in waited.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                report = "\n".join(f"rank {r}: rc={p.poll()}\n{self.describe(r)}" for r, p in self.processes.items())
                raise AssertionError(f"the job did not finish within {timeout} s\n{report}") from None
        return {rank: RankResult(rank, p.returncode, *self.output(rank)) for rank, p in waited.items()}

    def describe(self, rank: int) -> str:
        stdout, stderr = self.output(rank)
        return f"--- stdout\n{stdout}--- stderr\n{stderr}"

    def report(self) -> str:
        return "\n".join(f"rank {r} (rc={p.poll()}):\n{self.describe(r)}" for r, p in self.processes.items())

    def kill(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        kill_tagged(self.base_env[JOB_TAG_VARIABLE])
        self.store.close()


class HoldingRelay:
    """A TCP relay in front of the store for the ranks pointed at it (RVOD_RENDEZVOUS_PORT=relay.port) that
    forwards everything until a request carries `pattern` (a store key), then holds that request back for
    good: the rank stays stuck right before that request, at a known point, for as long as the test likes.
    `held` is set once it happened. Use as a context manager."""

    def __init__(self, store_port: int, pattern: bytes):
        self.store_port = store_port
        self.pattern = pattern
        self.held = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                rank_side, _ = self.listener.accept()
                store_side = socket.create_connection(("127.0.0.1", self.store_port))
            except OSError:
                return
            self.sockets += [rank_side, store_side]
            threading.Thread(target=self._pump, args=(rank_side, store_side, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(store_side, rank_side, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_rank: bool) -> None:
        tail = b""
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    return
                if from_rank and self.pattern in tail + data:
                    self.held.set()
                    return  # neither this request nor anything after it reaches the store
                tail = (tail + data)[-len(self.pattern):]
                sink.sendall(data)
            except OSError:
                return

    def __enter__(self) -> HoldingRelay:
        return self

    def __exit__(self, *exc) -> None:
        for sock in self.sockets:
            sock.close()


# ------------------------------------------------------------------------------------------ store client

MAGIC = b"RVOD"
VERSION = 1
PURPOSE_STORE = 1
PURPOSE_MESH = 2
CONNECTOR_LABEL = b"rvod handshake: connector proof\0"
ACCEPTOR_LABEL = b"rvod handshake: acceptor proof\0"
OP_SET = 1
OP_GET = 2
STATUS_OK = 0


class FakeHostsJob(LocalJob):
    """A LocalJob whose ranks get rvodrun's environment for `hosts` (host names are only names here)."""

    def __init__(self, hosts: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = assign_slots(parse_hosts(hosts), self.size)

    def env_for(self, rank: int) -> dict[str, str]:
        return worker_env(self.base_env, self.slots[rank], rendezvous_addr="127.0.0.1", rendezvous_port=self.port,
                          secret=self.secret, settings={})


def recv_exactly(sock: socket.socket, count: int) -> bytes:
    """`count` bytes, or fewer if the peer closes (or resets) the connection first."""
    data = b""
    while len(data) < count:
        try:
            chunk = sock.recv(count - len(data))
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


class HandshakeRefused(Exception):
    """The acceptor dropped the connection instead of answering our proof."""


class StoreConnection:
    """A client of the rendezvous store (or a mesh listener) that proves knowledge of `secret`."""

    def __init__(self, port: int, secret: bytes, purpose: int = PURPOSE_STORE, claim: bytes = b"",
                 timeout: float = 10.0, host: str = "127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        nonce = os.urandom(32)
        self.sock.sendall(MAGIC + struct.pack(">HB", VERSION, purpose) + nonce + struct.pack(">H", len(claim)) + claim)
        challenge = recv_exactly(self.sock, 4 + 2 + 1 + 32)
        if len(challenge) != 39:
            raise HandshakeRefused(f"no challenge (got {len(challenge)} bytes)")
        assert challenge[:7] == MAGIC + struct.pack(">HB", VERSION, purpose), challenge[:7]
        transcript = (struct.pack(">HB", VERSION, purpose) + nonce + challenge[7:]
                      + struct.pack(">H", len(claim)) + claim)
        self.sock.sendall(hmac.new(secret, CONNECTOR_LABEL + transcript, hashlib.sha256).digest())
        verdict = recv_exactly(self.sock, 33)
        if len(verdict) != 33:
            raise HandshakeRefused(f"no verdict (got {len(verdict)} bytes): the acceptor dropped the connection")
        expected = hmac.new(secret, ACCEPTOR_LABEL + transcript, hashlib.sha256).digest()
        assert hmac.compare_digest(verdict[:32], expected), "the acceptor's proof is wrong"
        assert verdict[32] == 1, "the acceptor did not accept us"

    def set(self, key: str, value: bytes) -> None:
        encoded = key.encode()
        self.sock.sendall(struct.pack(">BH", OP_SET, len(encoded)) + encoded + struct.pack(">I", len(value)) + value)
        status = recv_exactly(self.sock, 1)
        assert status == bytes([STATUS_OK]), f"SET {key} answered {status!r}"

    def get(self, key: str, wait_ms: int = 10_000) -> bytes | None:
        encoded = key.encode()
        self.sock.sendall(struct.pack(">BH", OP_GET, len(encoded)) + encoded + struct.pack(">Q", wait_ms))
        status = recv_exactly(self.sock, 1)
        assert status, "the store closed the connection"
        if status[0] != STATUS_OK:
            return None
        (length,) = struct.unpack(">I", recv_exactly(self.sock, 4))
        return recv_exactly(self.sock, length)

    def close(self) -> None:
        self.sock.close()


def is_dropped(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True if the peer closes `sock` (EOF or reset) within `timeout` without sending anything more."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def hierarchical_runs_by_phase(stderr: str) -> dict[str, dict[str, int | None]]:
    """From one rank's debug log of workers/hierarchical.py: per phase (its "PHASE name" lines), how many
    hierarchical allreduces and allgathers the engine ran, and the size in bytes of the smallest one."""
    phases: dict[str, dict[str, int | None]] = {}
    for section in stderr.split("PHASE ")[1:]:
        name, _, log = section.partition("\n")
        counts: dict[str, int | None] = {
            op: len(re.findall(rf"hierarchical {op} of \d+ bytes", log)) for op in ("allreduce", "allgather")}
        sizes = [int(size) for size in re.findall(r"hierarchical \w+ of (\d+) bytes", log)]
        counts["smallest"] = min(sizes, default=None)
        phases[name] = counts
    return phases


def assert_worker_job(result, passed: dict[int, int]) -> None:
    """An rvodrun job of a worker script (see workers/_check.py) exited 0 and every rank reported the given
    number of passed checks and no failure (a section skipped by mistake shows as a wrong count)."""
    found = verdicts(result.stdout)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    assert found == {rank: (count, 0) for rank, count in passed.items()}, report
    assert result.returncode == 0, report
