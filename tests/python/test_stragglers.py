"""Stragglers named (issue 37 item 3): a rank whose steps take 1.5x the others' is named by every rank's
``hvd.straggler_report()`` within 10 steps, warned about once by rank 0 (naming it), and marked in the
timeline; over 10,000 balanced steps nobody is named. The rule itself is unit-tested in
src/coordinator/lateness.rs."""

import json
import re
import sys

import pytest
from jobs import WORKERS, assert_worker_job

WORKER = str(WORKERS / "stragglers.py")


@pytest.mark.timeout(120)
def test_a_rank_slowed_one_and_a_half_times_is_named_warned_about_and_marked(run_rvodrun, tmp_path):
    timeline = tmp_path / "timeline.json"
    result = run_rvodrun(["-np", "4", "--timeline-filename", str(timeline), sys.executable, WORKER, "slow"],
                         timeout=100)
    assert_worker_job(result, {0: 3, 1: 3, 2: 3, 3: 3})
    warnings = re.findall(r"rank 3 is holding the others back: last in (\d+) of the last 10 rounds", result.stderr)
    assert len(warnings) == 1 and int(warnings[0]) >= 8, result.stderr[-3000:]
    assert "rank 0 is holding" not in result.stderr and "rank 1 is holding" not in result.stderr
    events = json.loads(timeline.read_text())
    marks = [e for e in events if e.get("name") == "STRAGGLER"]
    assert marks and {e["args"]["rank"] for e in marks} == {3}, marks
    assert "last in" in marks[0]["args"]["why"]


@pytest.mark.timeout(180)
def test_nobody_is_named_over_ten_thousand_balanced_steps(run_rvodrun):
    result = run_rvodrun(["-np", "4", sys.executable, WORKER, "balanced"], timeout=170)
    assert_worker_job(result, {0: 1, 1: 1, 2: 1, 3: 1})
    assert "holding the others back" not in result.stderr, result.stderr[-3000:]
