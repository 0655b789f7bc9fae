"""Reduce-scatter and allgather through shared memory's staging areas (``ring::staged_blocks``): exact values
on 2 and 3 ranks of one host (workers/staged_blocks.py), and, read from the timeline, which ops ran staged:
allgathers on two ranks or more unless RVOD_ALLGATHER_ALGORITHM names one, reduce-scatters on three or more
(two ranks keep their pipelined exchange), nothing over TCP."""

from __future__ import annotations

import json
import sys

import pytest
from jobs import WORKERS, assert_worker_job

CHECKS = 6


def algorithms(timeline, prefix):
    """The algorithms the timeline names for the ops whose tensor names start with ``prefix``, per rank."""
    events = json.loads(timeline.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    found = {}
    for e in events:
        if e.get("ph") == "X" and rows.get(e["pid"], "").split(".", 1)[-1].startswith(prefix):
            if e["name"].endswith(("_ALLGATHER", "_REDUCESCATTER")) and not e["name"].startswith("NEGOTIATE"):
                found.setdefault(e["tid"], set()).add(e.get("args", {}).get("algorithm"))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks, settings, allgather, reducescatter", [
    (3, {}, "staged", "staged"),
    (3, {"RVOD_ALLGATHER_ALGORITHM": "ring"}, "ring", "staged"),
    (2, {}, "staged", None),
    (3, {"RVOD_SHM": "0"}, "ring", None),
], ids=["3-ranks", "3-ranks-allgather-ring", "2-ranks", "3-ranks-tcp"])
def test_values_and_which_ops_run_staged(run_rvodrun, job_env, tmp_path, ranks, settings, allgather, reducescatter):
    timeline = tmp_path / "timeline.json"
    job_env.update(settings, RVOD_TIMELINE=str(timeline))
    result = run_rvodrun(["-np", str(ranks), "--verbose", sys.executable, str(WORKERS / "staged_blocks.py")],
                         timeout=100)
    assert_worker_job(result, {rank: CHECKS for rank in range(ranks)})
    assert algorithms(timeline, "ag.large") == {r: {allgather} for r in range(ranks)}
    assert algorithms(timeline, "rs.sum") == {r: {reducescatter} for r in range(ranks)}
    assert algorithms(timeline, "rs.burst") == {r: {reducescatter} for r in range(ranks)}
    # --verbose says it once per communicator and collective.
    said = "by staged (through the shared staging areas; first at"
    assert (f"allgather {said}" in result.stderr) == (allgather == "staged"), result.stderr[-3000:]
    assert (f"reducescatter {said}" in result.stderr) == (reducescatter == "staged"), result.stderr[-3000:]
