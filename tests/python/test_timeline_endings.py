"""A timeline keeps what it recorded however the job ends (issue 28, item 4): a peer SIGKILLed (the
survivor raises, then rvodrun sends it SIGTERM), an unhandled exception, SIGTERM from rvodrun, a normal
exit. After each, the file loads with json and holds every round the ranks completed; the killed rank's own
last events may be lost (at most its last 100 ms), never the survivor's. Each ending runs several times
(the kill 20 times), two jobs at a time, so a race between recording and the end shows. Worker:
workers/timeline_endings.py. About 60 s in all."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from jobs import WORKERS

from conftest import JOB_TAG_VARIABLE, RVODRUN, kill_tagged

WORKER = str(WORKERS / "timeline_endings.py")
ROUNDS = 150
RUN_TIMEOUT = 40


def rounds_on_disk(path: Path) -> dict[tuple[str, int], set[int]]:
    """(op, rank) -> the rounds whose op span that rank recorded; json.load must take the file."""
    with open(path) as f:
        events = json.load(f)
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    found: dict[tuple[str, int], set[int]] = {}
    for e in events:
        if e.get("ph") == "X" and e["name"] in ("ALLREDUCE", "ALLGATHER"):
            row = rows[e["pid"]]  # e.g. allreduce.ar.17
            found.setdefault((e["name"], e["tid"]), set()).add(int(row.rsplit(".", 1)[1]))
    return found


def run_job(job_env: dict[str, str], path: Path, mode: str) -> tuple[int, str]:
    env = dict(job_env, RVOD_TIMELINE=str(path))
    command = [sys.executable, *RVODRUN, "-np", "2", sys.executable, WORKER, mode, str(ROUNDS)]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, errors="replace",
                                timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        kill_tagged(job_env[JOB_TAG_VARIABLE])
        pytest.fail(f"{mode}: the job did not end within {RUN_TIMEOUT} s: {e.stderr}")
    return result.returncode, result.stderr


def run_many(job_env, tmp_path: Path, mode: str, runs: int) -> list[tuple[Path, int, str]]:
    paths = [tmp_path / f"{mode}{i}.json" for i in range(runs)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda path: run_job(job_env, path, mode), paths))
    return [(path, code, stderr) for path, (code, stderr) in zip(paths, results)]


def assert_every_round(found, ranks, path, stderr):
    everything = set(range(ROUNDS))
    for op in ("ALLREDUCE", "ALLGATHER"):
        for rank in ranks:
            missing = everything - found.get((op, rank), set())
            assert not missing, f"{path.name}: rank {rank} lost {len(missing)} {op} rounds\n{stderr[-2000:]}"


@pytest.mark.timeout(150)
def test_the_survivor_of_a_sigkilled_peer_keeps_every_round(job_env, tmp_path):
    for path, code, stderr in run_many(job_env, tmp_path, "kill", 20):
        assert code != 0, stderr
        assert "rank 1" in stderr and "SIGKILL" in stderr, stderr
        found = rounds_on_disk(path)
        assert_every_round(found, [0], path, stderr)
        # The killed rank may lose its last batch, nothing before it.
        for op in ("ALLREDUCE", "ALLGATHER"):
            kept = found.get((op, 1), set())
            assert kept == set(range(len(kept))), f"{path.name}: rank 1's {op} rounds have holes: {sorted(kept)}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "sigterm", "exit"])
def test_every_rank_keeps_every_round_however_the_job_ends(job_env, tmp_path, mode):
    for path, code, stderr in run_many(job_env, tmp_path, mode, 4):
        if mode == "exit":
            assert code == 0, stderr
        else:
            assert code != 0, stderr
        if mode == "raise":
            assert "RuntimeError: rank 1 gives up" in stderr, stderr
        if mode == "sigterm":
            assert "received SIGTERM" in stderr, stderr
        assert_every_round(rounds_on_disk(path), [0, 1], path, stderr)
