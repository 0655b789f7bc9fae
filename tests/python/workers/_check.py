"""What every worker script shares: a failure collector that keeps the ranks in step.

A check that fails records its traceback and the script goes on with the next check, so one run reports
every broken case; ``finish()`` prints a one-line verdict per rank and exits non-zero on any failure.
Only assertions about local results may fail inside a check: every rank still issues the same
collectives in the same order, so a failing check never leaves a peer waiting.
"""

import contextlib
import re
import sys
import time
import traceback

_failures = []
_passed = 0


@contextlib.contextmanager
def check(label):
    global _passed
    try:
        yield
    except Exception:  # noqa: BLE001 - every failure is reported at the end
        _failures.append(f"{label}:\n{traceback.format_exc()}")
    else:
        _passed += 1


def wait_done(poll, handle, timeout=30.0):
    """Polls ``handle`` until it completes; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not poll(handle):
        if time.monotonic() > deadline:
            raise AssertionError(f"handle {handle} did not complete within {timeout} s")
        time.sleep(0.0005)


def say(line):
    """Prints ``line`` to stdout in one write, so that ranks sharing a pipe (torchrun, mpirun) never interleave
    a line with another rank's (``print`` writes the text and its newline separately)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def finish(rank):
    for failure in _failures:
        print(f"FAIL rank {rank}: {failure}", file=sys.stderr)
    say(f"rank {rank}: {_passed} checks passed, {len(_failures)} failed")
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(1 if _failures else 0)


def expect_error(error_type, pattern, call, *args, **kwargs):
    """Runs ``call``; it must raise ``error_type`` with a message matching ``pattern``. Returns the message."""
    try:
        call(*args, **kwargs)
    except error_type as error:
        message = str(error)
        assert re.search(pattern, message), f"{type(error).__name__} message {message!r} does not match {pattern!r}"
        return message
    except Exception as error:
        raise AssertionError(f"expected {error_type.__name__}, got {type(error).__name__}: {error}") from error
    raise AssertionError(f"expected {error_type.__name__} matching {pattern!r}, nothing was raised")
