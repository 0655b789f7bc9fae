"""Pinning the engine threads (RVOD_THREAD_AFFINITY / HOROVOD_THREAD_AFFINITY / rvodrun --thread-affinity):
2-rank jobs whose workers (workers/affinity.py) report where their engine and main threads may run."""

from __future__ import annotations

import os
import re
import sys

import pytest
from jobs import WORKERS

ALLOWED = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to pin two ranks apart")
REPORT = re.compile(r"^\[(\d)\]<stdout>:rank (\d): engine \[([\d, ]*)\] main \[([\d, ]*)\]$", re.MULTILINE)


def reports(result):
    found = {int(m.group(2)): ([int(c) for c in m.group(3).split(",")], [int(c) for c in m.group(4).split(",")])
             for m in REPORT.finditer(result.stdout) if m.group(1) == m.group(2)}
    assert result.returncode == 0 and set(found) == {0, 1}, f"{result.stdout}\n{result.stderr}"
    return found


@pytest.mark.timeout(60)
def test_each_local_ranks_engine_thread_is_pinned_to_its_core_and_nothing_else_is(run_rvodrun):
    first, second = ALLOWED[0], ALLOWED[1]
    result = run_rvodrun(["-np", "2", "--thread-affinity", f"{second},{first}", sys.executable,
                          str(WORKERS / "affinity.py")], timeout=45)
    found = reports(result)
    assert found[0][0] == [second] and found[1][0] == [first], found
    assert found[0][1] == ALLOWED and found[1][1] == ALLOWED, "the main threads must stay unpinned"


@pytest.mark.timeout(60)
def test_too_few_cores_for_the_local_ranks_is_logged_and_pins_nothing(run_rvodrun, job_env):
    job_env["HOROVOD_THREAD_AFFINITY"] = str(ALLOWED[0])
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "affinity.py")], timeout=45)
    found = reports(result)
    assert found[0][0] == ALLOWED and found[1][0] == ALLOWED, found
    assert re.search(r"ERROR.*HOROVOD_THREAD_AFFINITY=.*1 core\(s\) for 2 local ranks.*not pinned", result.stderr), \
        result.stderr
