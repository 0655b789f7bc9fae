"""Multi-process tests of process sets through rvod.numpy, run with rvodrun on 4 and 3 ranks.

The worker side is workers/process_sets.py (one mode per job; see there for every case). Each job checks
every case on every rank and reports the failing ones by name; these tests check the verdicts, and what
only the job's output shows: the stall warning of one set, logged by that set's coordinator.
"""

from __future__ import annotations

import re

import pytest
from jobs import PYTHON, WORKERS, failures, verdicts

WORKER = str(WORKERS / "process_sets.py")


def run_mode(run_rvodrun, job_env, mode, size, timeout=60, **settings):
    for name in ("RVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_DYNAMIC_PROCESS_SETS", "RVOD_STALL_CHECK_TIME_SECONDS",
                 "HOROVOD_STALL_CHECK_TIME_SECONDS", "RVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE"):
        job_env.pop(name, None)
    job_env.update(settings)
    result = run_rvodrun(["-np", str(size), PYTHON, WORKER, mode], timeout=timeout)
    report = (f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\n"
              f"stderr:\n{failures(result.stderr)[-20000:]}")
    found = verdicts(result.stdout)
    assert set(found) == set(range(size)), report
    assert all(failed == 0 for _, failed in found.values()), report
    assert result.returncode == 0, report
    return result, found


def rank_stderr(text: str, rank: int) -> str:
    return "\n".join(re.findall(rf"^\[{rank}\]<stderr>:(.*)$", text, re.MULTILINE))


@pytest.mark.timeout(60)
def test_static_sets_every_op_concurrency_and_stall(run_rvodrun, job_env):
    """4 ranks, sets [0, 2], [1, 3], [0, 1, 2] registered at init: the API, every op on every set with exact
    values, refusals, a mismatch inside a set; then the two disjoint sets at once while rank 3 sleeps ~4.5 s:
    the even set finishes while rank 1 waits, and rank 1 (the odd set's coordinator) warns naming set 2 and
    the missing global rank 3."""
    result, found = run_mode(run_rvodrun, job_env, "static", 4, RVOD_STALL_CHECK_TIME_SECONDS="2")
    # Members run more checks than non-members, but every rank ran a full suite on each of its sets.
    assert min(passed for passed, _ in found.values()) > 90, found

    warnings = rank_stderr(result.stderr, 1)
    match = re.search(r"In process set 2 \(ranks \[1, 3\]\): One or more tensors were submitted .* waiting for "
                      r"remainder of ranks for more than \d+ seconds", warnings)
    assert match, f"no stall warning for process set 2 from rank 1:\n{result.stderr[-5000:]}"
    missing = re.findall(r"^(\d+)!?: \[(.*)\]$", warnings, re.MULTILINE)
    assert missing and all(rank == "3" and "allreduce.ps.stall" in names for rank, names in missing), warnings
    # Nobody else stalled: no warning about the even set, the trio or the global set.
    for rank in (0, 2, 3):
        assert "waiting for remainder of ranks" not in rank_stderr(result.stderr, rank), result.stderr[-5000:]
    assert "In the global process set" not in result.stderr and "In process set 1 " not in result.stderr, \
        result.stderr[-5000:]


@pytest.mark.timeout(60)
def test_dynamic_sets_add_remove_readd_and_mismatched_registration(run_rvodrun, job_env):
    """3 ranks: mismatched static sets at init; add refused without dynamic mode, allowed with
    RVOD_/HOROVOD_DYNAMIC_PROCESS_SETS=1 or init(process_sets="dynamic"); every op on the added sets [0, 2], [1]
    and [1, 2]; duplicates; mismatched add_process_set (every rank raises, the job goes on); remove;
    re-add with freed ids reused in the order they were freed."""
    _, found = run_mode(run_rvodrun, job_env, "dynamic", 3)
    assert min(passed for passed, _ in found.values()) > 90, found


@pytest.mark.timeout(60)
def test_unnamed_ops_stay_matched_around_process_sets(run_rvodrun, job_env):
    """3 ranks, set [0, 2]: an unnamed global allreduce must still match on every rank after rank 1 was
    refused an unnamed op on the set, and after ranks 0 and 2 ran unnamed ops on their set."""
    run_mode(run_rvodrun, job_env, "naming", 3, timeout=45)


@pytest.mark.timeout(60)
def test_an_op_pending_on_a_removed_set_fails_naming_the_removal(run_rvodrun, job_env):
    """3 ranks, set [0, 2], rank 2's allreduce on it pending (rank 0 never submits it): when the set is removed
    the op fails with RvodInternalError naming process set 1, its ranks and remove_process_set() (and rank 0
    when rank 0 removed it while rank 2 waited), never "called shutdown()"; a global allreduce and the set
    added again work afterwards."""
    _, found = run_mode(run_rvodrun, job_env, "removal", 3, timeout=45)
    assert found == {0: (5, 0), 1: (5, 0), 2: (6, 0)}, found
