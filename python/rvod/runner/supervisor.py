"""Runs a job's workers to the end: starts them, forwards their output, and stops them together.

Each worker starts in a new session, hence its own process group: stopping a worker's group also stops
the processes it started, and a Ctrl-C in the terminal reaches rvodrun alone, which passes it on.
The first worker to fail (non-zero exit, or killed by a signal) is named on stderr and the others get
SIGTERM; a SIGINT, SIGTERM or SIGHUP sent to rvodrun is forwarded to every worker. Workers still running
a grace period later get SIGKILL, and so does anything left in a worker's group once the job is over.
"""

from __future__ import annotations

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

STOP_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05
# A worker's last lines are forwarded before its exit is reported, unless a stray child keeps the pipe open.
_OUTPUT_DRAIN_SECONDS = 1.0
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class WorkerSpec:
    """What to run as one rank. With `output_dir`, its output is also written to `output_dir/{stdout,stderr}`."""

    rank: int
    command: list[str]
    env: dict[str, str]
    output_dir: Path | None = None


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


class _Worker:
    def __init__(self, rank: int, process: subprocess.Popen[bytes], forwarders: list[threading.Thread]):
        self.rank = rank
        self.process = process
        self.forwarders = forwarders
        self._exited_at: float | None = None

    @classmethod
    def start(cls, spec: WorkerSpec) -> _Worker:
        copies: tuple[IO[bytes] | None, IO[bytes] | None] = (None, None)
        if spec.output_dir is not None:
            spec.output_dir.mkdir(parents=True, exist_ok=True)
            copies = (open(spec.output_dir / "stdout", "wb"), open(spec.output_dir / "stderr", "wb"))
        try:
            process = subprocess.Popen(
                spec.command,
                env=spec.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError:
            for copy in copies:
                if copy is not None:
                    copy.close()
            raise
        assert process.stdout is not None and process.stderr is not None
        forwarders = [
            start_forwarding(process.stdout, f"[{spec.rank}]<stdout>:", sys.stdout, copies[0]),
            start_forwarding(process.stderr, f"[{spec.rank}]<stderr>:", sys.stderr, copies[1]),
        ]
        return cls(spec.rank, process, forwarders)

    def name(self) -> str:
        return f"rank {self.rank} (pid {self.process.pid})"

    def signal_group(self, signum: int) -> None:
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


class Supervisor:
    def __init__(self, *, grace_seconds: float = STOP_GRACE_SECONDS, verbose: bool = False):
        self._grace_seconds = grace_seconds
        self._verbose = verbose

    def run(self, specs: list[WorkerSpec]) -> int:
        """Starts every worker, waits for all of them, and returns the job's exit status."""
        received: list[int] = []
        previous_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in _FORWARDED_SIGNALS:
                previous_handlers[signum] = signal.signal(signum, lambda number, _frame: received.append(number))
        workers: list[_Worker] = []
        try:
            exit_code = 0
            for spec in specs:
                try:
                    worker = _Worker.start(spec)
                except OSError as error:
                    _say(f"cannot start rank {spec.rank} ({shlex.join(spec.command)}): {error}")
                    exit_code = 1
                    break
                workers.append(worker)
                if self._verbose:
                    _say(f"started {worker.name()}: {shlex.join(spec.command)}")
            return self._watch(workers, received, exit_code)
        finally:
            self._clear_groups(workers)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    def _stop(self, workers: list[_Worker], signum: int) -> float:
        """Sends `signum` to the workers' groups; returns when to escalate to SIGKILL."""
        for worker in workers:
            worker.signal_group(signum)
        return time.monotonic() + self._grace_seconds

    def _watch(self, workers: list[_Worker], received: list[int], exit_code: int) -> int:
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
                _say(f"received {signal_name(signum)}, stopping {_ranks(len(running))}")
                exit_code, stopping = 128 + signum, True
                kill_at = self._stop(running, signum)
            for worker in [worker for worker in running if worker.finished()]:
                running.remove(worker)
                returncode = worker.process.returncode
                if returncode != 0 and not stopping:
                    _say(f"{worker.name()} {describe_exit(returncode)}")
                    if running:
                        _say(f"stopping the other {_ranks(len(running))}")
                    exit_code, stopping = exit_status(returncode), True
                    kill_at = self._stop(running, signal.SIGTERM)
                elif self._verbose:
                    _say(f"{worker.name()} {describe_exit(returncode)}")
            if kill_at is not None and time.monotonic() >= kill_at:
                if running:
                    _say(f"killing {_ranks(len(running))} that did not stop")
                self._stop(running, signal.SIGKILL)
                kill_at = None
        return exit_code

    def _clear_groups(self, workers: list[_Worker]) -> None:
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
