"""One rank of an ``rvod.spark.run`` job, in a process of its own under the Spark task.

A process per rank, not the Spark Python worker itself: Spark reuses its workers for later tasks, and an
engine (its rendezvous scope, its threads) must not outlive the job it joined. The process dies with the
task's worker (PR_SET_PDEATHSIG), so a cancelled Spark job leaves no rank waiting.

``python -m rvod.spark.rank_process PAYLOAD RESULT``: reads the cloudpickled ``(fn, args, kwargs)`` from
PAYLOAD, runs it, writes ``(True, result)`` or ``(False, cluster_job.Failure)`` cloudpickled to RESULT.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

_PR_SET_PDEATHSIG = 1

# A rank's folder (payload, result, captured output) is named after the task's process, so a later task can
# tell a folder left behind by a task Spark killed (no Python cleanup runs then) from one still in use.
_WORKDIR_PREFIX = "rvod-spark-"
_WORKDIR_NAME = re.compile(re.escape(_WORKDIR_PREFIX) + r"(\d+)-rank\d+-[^/]+")


def workdir(rank: int) -> tempfile.TemporaryDirectory[str]:
    """A private folder for ``rank``'s files, removed when the context ends; first removes the folders of
    tasks whose process is gone."""
    remove_orphaned_workdirs()
    return tempfile.TemporaryDirectory(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-rank{rank}-")


def remove_orphaned_workdirs(root: str | None = None) -> list[str]:
    """Remove the rank folders in ``root`` (default: the temporary directory) whose task process no longer
    exists; returns their paths. Another user's folders, and those of live processes, are left alone."""
    root = tempfile.gettempdir() if root is None else root
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _WORKDIR_NAME.fullmatch(entry.name)
        if match is None or _alive(int(match.group(1))) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
        except FileNotFoundError:
            continue  # another task (this job's other rank) removed it first
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL when the task's worker goes away."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the worker died before the signal was armed


def run_rank(rank: int, payload: bytes, env: Mapping[str, str], workdir: str,
             capture: bool) -> tuple[bool, Any, str, str]:
    """Run the payload in a child process; ``(succeeded, result or Failure, stdout, stderr)``, the output
    only when ``capture`` (else it goes to the executor's own output)."""
    payload_path = os.path.join(workdir, f"rank{rank}.payload")
    result_path = os.path.join(workdir, f"rank{rank}.result")
    out_path = os.path.join(workdir, f"rank{rank}.out")
    err_path = os.path.join(workdir, f"rank{rank}.err")
    with open(os.open(payload_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
        file.write(payload)
    command = [sys.executable, "-m", "rvod.spark.rank_process", payload_path, result_path]
    if capture:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            status = subprocess.call(command, env=dict(env), stdout=out, stderr=err, preexec_fn=_die_with_parent)
        with open(out_path, encoding="utf-8", errors="replace") as out, \
                open(err_path, encoding="utf-8", errors="replace") as err:
            stdout, stderr = out.read(), err.read()
    else:
        status = subprocess.call(command, env=dict(env), preexec_fn=_die_with_parent)
        stdout = stderr = ""
    try:
        with open(result_path, "rb") as file:
            succeeded, value = pickle.load(file)
    except (OSError, EOFError, pickle.UnpicklingError):
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        from rvod.runner.cluster_job import Failure

        succeeded, value = False, Failure(rank, f"rank {rank}'s process {how} before returning a result",
                                          host=socket.gethostname())
    return succeeded, value, stdout, stderr


def main(payload_path: str, result_path: str) -> int:
    import cloudpickle

    from rvod.runner import cluster_job

    rank = int(os.environ["RVOD_RANK"])
    with open(payload_path, "rb") as file:
        fn, args, kwargs = pickle.load(file)
    outcome = cluster_job.call(rank, fn, args, kwargs)
    try:
        data = cloudpickle.dumps(outcome)
    except Exception as error:  # noqa: BLE001 - a result that cannot be pickled is this rank's failure
        failure = cluster_job.Failure(rank, f"rank {rank}'s result cannot be pickled: {error!r}",
                                      host=socket.gethostname())
        data = cloudpickle.dumps((False, failure))
    with open(result_path + ".part", "wb") as file:
        file.write(data)
    os.replace(result_path + ".part", result_path)
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
