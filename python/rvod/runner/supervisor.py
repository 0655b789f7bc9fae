"""Runs a job's workers to the end: starts them, forwards their output, and stops them together.

Each worker starts in a new session, hence its own process group: stopping a worker's group also stops
the processes it started, and a Ctrl-C in the terminal reaches rvodrun alone, which passes it on.
A worker on another host is an ssh client running `rvod.runner.remote` there: it gets its request (command,
directory, environment with the secret) on ssh's stdin, signals as `signal N` lines, and when the ssh
client ends, the remote side stops the rank's group. Its exit comes back as a status line on stderr.
The first worker to fail (non-zero exit, or killed by a signal; a killed one before the peers that failed
with it) is named on stderr and the others get SIGTERM; a SIGINT, SIGTERM or SIGHUP sent to rvodrun is
forwarded to every worker. Workers still running a grace period later get SIGKILL, and so does anything left
in a worker's group once the job is over.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rvod.runner.output import start_forwarding, write_line
from rvod.runner.remote import STATUS_MARKER
from rvod.runner.ssh import SSH_FAILED

STOP_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05
# A worker's last lines are forwarded before its exit is reported, unless a stray child keeps the pipe open.
_OUTPUT_DRAIN_SECONDS = 1.0
# When a worker fails, the others that end within this long are looked at too: a rank killed by a signal
# makes its peers fail a collective a moment later, and it (the cause) is the one named first.
_SETTLE_SECONDS = 0.5
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class WorkerSpec:
    """What to run as one rank. With `output_dir`, its output is also written to `output_dir/{stdout,stderr}`."""

    rank: int
    command: list[str]
    env: dict[str, str]
    output_dir: Path | None = None
    hostname: str = "localhost"
    # For a rank on another host: the ssh command line that runs rvod.runner.remote there.
    ssh_command: list[str] | None = None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def exit_status(returncode: int) -> int:
    """The status a shell would report for a process that ended with `returncode`."""
    return 128 - returncode if returncode < 0 else returncode


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def _say(text: str) -> None:
    write_line(sys.stderr, f"rvodrun: {text}")


class WorkerProcess:
    def __init__(self, spec: WorkerSpec, process: subprocess.Popen[bytes]):
        self.rank = spec.rank
        self.hostname = spec.hostname
        self.remote = spec.ssh_command is not None
        self.process = process
        self.forwarders: list[threading.Thread] = []
        self.remote_pid: int | None = None
        self.remote_returncode: int | None = None
        self._exited_at: float | None = None

    @classmethod
    def start(cls, spec: WorkerSpec, *, timestamp: bool = False) -> WorkerProcess:
        copies: tuple[IO[bytes] | None, IO[bytes] | None] = (None, None)
        if spec.output_dir is not None:
            spec.output_dir.mkdir(parents=True, exist_ok=True)
            copies = (open(spec.output_dir / "stdout", "wb"), open(spec.output_dir / "stderr", "wb"))
        try:
            if spec.ssh_command is None:
                process = subprocess.Popen(spec.command, env=spec.env, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            else:
                process = subprocess.Popen(spec.ssh_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, start_new_session=True)
        except OSError:
            for copy in copies:
                if copy is not None:
                    copy.close()
            raise
        worker = cls(spec, process)
        assert process.stdout is not None and process.stderr is not None
        worker.forwarders = [
            start_forwarding(process.stdout, f"[{spec.rank}]<stdout>:", sys.stdout, copies[0], timestamp=timestamp),
            start_forwarding(process.stderr, f"[{spec.rank}]<stderr>:", sys.stderr, copies[1], timestamp=timestamp,
                             status_marker=STATUS_MARKER if worker.remote else None, on_status=worker._on_status),
        ]
        if worker.remote:
            request = {"command": spec.command, "cwd": os.getcwd(), "env": spec.env}
            worker._send((json.dumps(request) + "\n").encode())
        return worker

    def _on_status(self, status: dict) -> None:
        if isinstance(status.get("pid"), int):
            self.remote_pid = status["pid"]
        if isinstance(status.get("returncode"), int):
            self.remote_returncode = status["returncode"]

    def _send(self, data: bytes) -> None:
        """Writes to a remote worker's ssh stdin; a connection that is gone is noticed by its exit."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def name(self, with_host: bool) -> str:
        pid = self.remote_pid if self.remote else self.process.pid
        where = f" on {self.hostname}" if with_host else ""
        return f"rank {self.rank}{where} (pid {pid})" if pid is not None else f"rank {self.rank}{where}"

    @property
    def returncode(self) -> int | None:
        """How the rank ended: its own status for a remote rank, as reported by the remote side."""
        if self.remote and self.remote_returncode is not None:
            return self.remote_returncode
        return self.process.returncode

    def describe_exit(self) -> str:
        returncode = self.returncode
        assert returncode is not None
        if self.remote and self.remote_returncode is None:
            if returncode == SSH_FAILED:
                return "lost its ssh connection (ssh exited with status 255)"
            return f"ended without a report from {self.hostname} (ssh exited with status {returncode})"
        return describe_exit(returncode)

    def signal_group(self, signum: int) -> None:
        if self.remote:
            self._send(f"signal {signum}\n".encode())
            if signum != signal.SIGKILL:
                return
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def group_alive(self) -> bool:
        self.process.poll()  # reap the leader, so a finished one does not keep its group alive
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def finished(self) -> bool:
        """Exited, with its output forwarded (or given up on, when a stray child holds the pipes open)."""
        if self.process.poll() is None:
            return False
        if self._exited_at is None:
            self._exited_at = time.monotonic()
        output_done = not any(thread.is_alive() for thread in self.forwarders)
        return output_done or time.monotonic() - self._exited_at >= _OUTPUT_DRAIN_SECONDS

    def finish_output(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.forwarders:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass


class Supervisor:
    """Runs workers to the end. With `name_hosts`, messages name each rank's host too (multi-host jobs);
    `failure` is the first failure's description once `run` returns."""

    def __init__(self, *, grace_seconds: float = STOP_GRACE_SECONDS, verbose: bool = False,
                 name_hosts: bool = False, timestamp: bool = False):
        self._grace_seconds = grace_seconds
        self._verbose = verbose
        self._name_hosts = name_hosts
        self._timestamp = timestamp
        self.failure: str | None = None

    def run(self, specs: list[WorkerSpec]) -> int:
        """Starts every worker, waits for all of them, and returns the job's exit status."""
        received: list[int] = []
        previous_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in _FORWARDED_SIGNALS:
                previous_handlers[signum] = signal.signal(signum, lambda number, _frame: received.append(number))
        workers: list[WorkerProcess] = []
        try:
            exit_code = 0
            for spec in specs:
                try:
                    worker = WorkerProcess.start(spec, timestamp=self._timestamp)
                except OSError as error:
                    self.failure = f"cannot start rank {spec.rank} ({shlex.join(spec.command)}): {error}"
                    _say(self.failure)
                    exit_code = 1
                    break
                workers.append(worker)
                if self._verbose:
                    _say(f"started {worker.name(self._name_hosts)}: {shlex.join(spec.command)}")
            return self._watch(workers, received, exit_code)
        finally:
            self._clear_groups(workers)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    def _stop(self, workers: list[WorkerProcess], signum: int) -> float:
        """Sends `signum` to the workers' groups; returns when to escalate to SIGKILL."""
        for worker in workers:
            worker.signal_group(signum)
        return time.monotonic() + self._grace_seconds

    def _watch(self, workers: list[WorkerProcess], received: list[int], exit_code: int) -> int:
        """Waits until every worker has exited; a non-zero `exit_code` means the job is already failing."""
        running = list(workers)
        stopping = exit_code != 0
        kill_at = self._stop(running, signal.SIGTERM) if stopping else None
        while running:
            time.sleep(_POLL_SECONDS)
            while received:
                signum = received.pop(0)
                if stopping:
                    kill_at = time.monotonic()  # asked again: no more grace
                    continue
                self.failure = f"rvodrun received {signal_name(signum)}"
                _say(f"received {signal_name(signum)}, stopping {_ranks(len(running))}")
                exit_code, stopping = 128 + signum, True
                kill_at = self._stop(running, signum)
            for worker in self._finished(running, settle=not stopping):
                running.remove(worker)
                returncode = worker.returncode
                assert returncode is not None
                description = f"{worker.name(self._name_hosts)} {worker.describe_exit()}"
                if returncode != 0 and not stopping:
                    self.failure = description
                    _say(description)
                    if running:
                        _say(f"stopping the other {_ranks(len(running))}")
                    exit_code, stopping = exit_status(returncode), True
                    kill_at = self._stop(running, signal.SIGTERM)
                elif self._verbose:
                    _say(description)
            if kill_at is not None and time.monotonic() >= kill_at:
                if running:
                    _say(f"killing {_ranks(len(running))} that did not stop")
                self._stop(running, signal.SIGKILL)
                kill_at = None
        return exit_code

    @staticmethod
    def _finished(running: list[WorkerProcess], settle: bool) -> list[WorkerProcess]:
        """The workers that have finished, a killed one before one that exited with an error.

        With `settle`, a failure waits up to _SETTLE_SECONDS for the others that end with it, so the rank whose
        death made its peers fail is the one named as the job's failure, not a peer that was reaped first.
        """
        finished = [worker for worker in running if worker.finished()]
        if settle and any(worker.returncode != 0 for worker in finished):
            deadline = time.monotonic() + _SETTLE_SECONDS
            while len(finished) < len(running) and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
                finished += [worker for worker in running if worker not in finished and worker.finished()]
        return sorted(finished, key=lambda worker: (worker.returncode or 0) >= 0)

    def _clear_groups(self, workers: list[WorkerProcess]) -> None:
        """Stops whatever is left in the workers' process groups, such as children a worker left behind."""
        alive = [worker for worker in workers if worker.group_alive()]
        self._stop(alive, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_seconds
        while alive and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            alive = [worker for worker in alive if worker.group_alive()]
        self._stop(alive, signal.SIGKILL)
        for worker in workers:
            worker.process.wait()
            worker.finish_output(_OUTPUT_DRAIN_SECONDS)
