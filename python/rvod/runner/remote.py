"""`python -m rvod.runner.remote`: starts one rank on a remote host, on behalf of rvodrun over ssh.

rvodrun sends one JSON line on standard input: the rank's command, working directory and environment
(the job secret travels here, never on a command line). The rank starts in its own process group with this
process's stdout and stderr (ssh carries them back). After that, standard input carries rvodrun's requests,
one per line: `signal N` sends signal N to the rank's group. When standard input ends (rvodrun stopped the
job, died, or the connection broke) the group gets SIGTERM, then SIGKILL after a grace period, so no rank
outlives its job. When the rank exits, a status line (`STATUS_MARKER` + JSON) on stderr tells rvodrun how
it ended; what is left in its group is stopped, and this process exits with the shell's status for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time


STATUS_MARKER = "\x1ervod-remote:"
STOP_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05


def report(**fields: object) -> None:
    """Writes a status line for rvodrun on stderr, on a line of its own."""
    sys.stderr.write(f"{STATUS_MARKER}{json.dumps(fields)}\n")
    sys.stderr.flush()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left of it after the grace period."""
    _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while time.monotonic() < deadline:
        process.poll()
        if not _group_alive(process.pid):
            return
        time.sleep(_POLL_SECONDS)
    _signal_group(process.pid, signal.SIGKILL)


def _follow_requests(process: subprocess.Popen[bytes]) -> None:
    """Applies rvodrun's `signal N` lines until standard input ends, then stops the rank's group."""
    for line in sys.stdin:
        word, _, number = line.strip().partition(" ")
        if word == "signal" and number.isdigit():
            _signal_group(process.pid, int(number))
    _stop_group(process)


def main() -> int:
    request = json.loads(sys.stdin.readline())
    env = dict(request["env"])
    try:
        os.chdir(request["cwd"])
    except OSError as error:
        print(f"rvodrun: cannot enter the working directory {request['cwd']!r} on this host: {error.strerror}",
              file=sys.stderr, flush=True)
        report(returncode=1)
        return 1
    try:
        process = subprocess.Popen(request["command"], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as error:
        print(f"rvodrun: cannot start {request['command'][0]!r}: {error}", file=sys.stderr, flush=True)
        report(returncode=127)
        return 127
    report(pid=process.pid)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: _signal_group(process.pid, number))
    threading.Thread(target=_follow_requests, args=(process,), name="rvod-remote-requests", daemon=True).start()
    returncode = process.wait()
    report(returncode=returncode)
    if _group_alive(process.pid):
        _stop_group(process)
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
