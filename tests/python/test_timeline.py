"""The Chrome-trace timeline (RVOD_TIMELINE, rvodrun --timeline-filename / --timeline-mark-cycles,
hvd.start_timeline / stop_timeline): one file holds every rank's rows, it names and phases each op, and it
is valid JSON at every moment, including after kill -9 or SIGINT of either rank and Ctrl-C of rvodrun; a
hierarchical op shows its steps. Workers: workers/timeline.py. About 60 s in all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from jobs import WORKERS, FakeHostsJob

from conftest import JOB_TAG_VARIABLE, kill_tagged

WORKER = str(WORKERS / "timeline.py")
# The transport's collective is named after it: shared memory unless the run turned it off.
TRANSPORT = "TCP" if os.environ.get("RVOD_SHM", os.environ.get("HOROVOD_SHM")) == "0" else "SHM"


class Trace:
    """A loaded timeline: rows by name, and each row's events."""

    def __init__(self, path: Path):
        self.events = json.loads(path.read_text())
        self.row_names = {e["pid"]: e["args"]["name"] for e in self.events
                          if e.get("ph") == "M" and e["name"] == "process_name"}
        self.by_row: dict[str, list[dict]] = defaultdict(list)
        for e in self.events:
            if e.get("ph") != "M":
                self.by_row[self.row_names.get(e["pid"], f"?{e['pid']}")].append(e)

    def names(self, row: str, tid: int | None = None) -> set[str]:
        return {e["name"] for e in self.by_row[row] if tid is None or e["tid"] == tid}

    def ranks(self, row: str) -> set[int]:
        return {e["tid"] for e in self.by_row[row]}


def assert_op_rows(trace: Trace, tag: str, ranks: set[int], transport: str = TRANSPORT):
    expected = {
        f"allreduce.{tag}.grad": ("ALLREDUCE", "float32", [4, 3]),
        f"allgather.{tag}.gathered": ("ALLGATHER", "int32", None),
        f"broadcast.{tag}.weights": ("BROADCAST", "int64", [6]),
        f"alltoall.{tag}.scattered": ("ALLTOALL", "float32", None),
        f"reducescatter.{tag}.rs": ("REDUCESCATTER", "float32", None),
    }
    for row, (op, dtype, shape) in expected.items():
        assert row in trace.by_row, f"no row {row}; rows: {sorted(trace.by_row)}"
        assert trace.ranks(row) == ranks, (row, trace.ranks(row))
        for rank in ranks:
            names = trace.names(row, rank)
            assert {f"NEGOTIATE_{op}", op, "QUEUE", f"{transport}_{op}"} <= names, (row, rank, names)
        spans = [e for e in trace.by_row[row] if e["name"] == op]
        assert all(e["ph"] == "X" and e["dur"] >= 0 and e["args"]["dtype"] == dtype for e in spans), spans
        if shape is not None:
            assert all(e["args"]["shape"] == shape for e in spans), spans
        ticks = {e["name"] for e in trace.by_row[row] if e["ph"] == "i"}
        assert ticks == {str(r) for r in ranks}, f"{row}: the coordinator ticks each ready rank: {ticks}"
        assert {e["tid"] for e in trace.by_row[row] if e["ph"] == "i"} == {min(ranks)}
    fused = [row for row in trace.by_row if f".{tag}.group" in row]
    assert fused, sorted(trace.by_row)
    assert {"MEMCPY_IN_FUSION_BUFFER", f"{transport}_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"} <= \
        set().union(*(trace.names(row) for row in fused)), {row: trace.names(row) for row in fused}


def assert_whole_microseconds_and_nested(trace: Trace):
    """Every "ts" and "dur" is a whole number of microseconds, and on each (pid, tid) row the spans nest or
    are disjoint: Perfetto drops a span that starts inside another and ends after it
    (slice_drop_overlapping_complete_event)."""
    timed = [e for e in trace.events if e.get("ph") != "M"]
    assert timed and all(type(e["ts"]) is int for e in timed), [e for e in timed if type(e["ts"]) is not int][:3]
    spans = defaultdict(list)
    for e in timed:
        if e["ph"] == "X":
            assert type(e["dur"]) is int and e["dur"] >= 0, e
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for row, row_spans in spans.items():
        open_spans: list[tuple[int, int, str]] = []  # the enclosing spans of the current one, outermost first
        for span in sorted(row_spans, key=lambda s: (s[0], -s[1])):
            while open_spans and open_spans[-1][1] <= span[0]:
                open_spans.pop()
            assert not open_spans or span[1] <= open_spans[-1][1], \
                f"{trace.row_names.get(row[0])} rank {row[1]}: {span} starts inside {open_spans[-1]} and ends after it"
            open_spans.append(span)


@pytest.mark.timeout(60)
def test_every_op_and_a_process_set_on_every_rank_in_one_file(run_rvodrun, job_env, tmp_path):
    path = tmp_path / "timeline.json"
    job_env["RVOD_DYNAMIC_PROCESS_SETS"] = "1"
    result = run_rvodrun(["-np", "3", "--timeline-filename", str(path), "--timeline-mark-cycles",
                          sys.executable, WORKER, "ops"], timeout=50)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    trace = Trace(path)
    assert_op_rows(trace, "step", {0, 1, 2})
    assert_whole_microseconds_and_nested(trace)
    pair = "allreduce.pair.grad (process set 1)"
    assert trace.ranks(pair) == {0, 2}, trace.ranks(pair)
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", f"{TRANSPORT}_ALLREDUCE"} <= trace.names(pair, 2)
    assert {e["args"]["process_set"] for e in trace.by_row[pair] if e["name"] == "ALLREDUCE"} == {1}
    cycles = [e for e in trace.by_row["rvod engine cycles"] if e["name"] == "CYCLE_START"]
    assert {e["tid"] for e in cycles} == {0, 1, 2}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace.events if e["name"] == "thread_name"}
    assert set(thread_names.values()) == {"rank 0", "rank 1", "rank 2"}


@pytest.mark.timeout(90)
def test_hierarchical_steps_are_phases_of_the_op(job_env, tmp_path):
    """Ranks on two (fake) hosts with hierarchical allreduce and allgather forced on: each op's bar holds the
    steps inside and across the hosts, on every rank."""
    path = tmp_path / "timeline.json"
    settings = {"RVOD_TIMELINE": str(path), "RVOD_HIERARCHICAL_ALLREDUCE": "1", "RVOD_HIERARCHICAL_ALLGATHER": "1"}
    job = FakeHostsJob("hosta:2,hostb:2", job_env, 4, [sys.executable, WORKER, "ops"], tmp_path, settings=settings)
    with job:
        job.start()
        results = job.wait(timeout=60)
        report = job.report()
    assert all(res.returncode == 0 for res in results.values()), report
    trace = Trace(path)
    assert_whole_microseconds_and_nested(trace)
    for rank in range(4):
        allreduce = trace.names("allreduce.step.grad", rank)
        assert {"ALLREDUCE", "SHM_REDUCESCATTER", "TCP_ALLREDUCE", "SHM_ALLGATHER"} <= allreduce, (rank, allreduce)
        assert "SHM+TCP_ALLREDUCE" not in allreduce, (rank, allreduce)
        allgather = trace.names("allgather.step.gathered", rank)
        assert {"ALLGATHER", "SHM_ALLGATHER", "TCP_ALLGATHER"} <= allgather, (rank, allgather)
    # The steps follow each other inside the op's bar, in order, on every rank.
    for rank in range(4):
        spans = sorted((e for e in trace.by_row["allreduce.step.grad"] if e["tid"] == rank and e["ph"] == "X"),
                       key=lambda e: e["ts"])
        steps = [e["name"] for e in spans if e["name"] in ("SHM_REDUCESCATTER", "TCP_ALLREDUCE", "SHM_ALLGATHER")]
        assert steps == ["SHM_REDUCESCATTER", "TCP_ALLREDUCE", "SHM_ALLGATHER"], (rank, steps)


@pytest.mark.timeout(60)
def test_dynamic_timeline_records_only_between_start_and_stop_and_switches_files(run_rvodrun, job_env, tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    job_env["HOROVOD_TIMELINE"] = "DYNAMIC"
    result = run_rvodrun(["-np", "2", sys.executable, WORKER, "dynamic", str(first), str(second)], timeout=50)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    a, b = Trace(first), Trace(second)
    assert_op_rows(a, "in_a", {0, 1})
    assert_op_rows(b, "in_b", {0, 1})
    for trace in (a, b):
        assert not [row for row in trace.by_row if ".before." in row or ".after." in row], sorted(trace.by_row)
    assert not [row for row in a.by_row if ".in_b." in row] and not [row for row in b.by_row if ".in_a." in row]
    # The op in flight at the switch is in one of the files, whole.
    switching = "allreduce.switching.grad"
    assert "ALLREDUCE" in a.names(switching) | b.names(switching)
    assert "CYCLE_START" in b.names("rvod engine cycles") and not a.by_row["rvod engine cycles"]


ERRORS = """
import rvod.numpy as hvd
for call in (lambda: hvd.start_timeline("t.json"), hvd.stop_timeline):
    try:
        call()
    except ValueError as e:
        print("before init:", e)
hvd.init()
for call in (lambda: hvd.start_timeline("t.json"), hvd.stop_timeline):
    try:
        call()
    except ValueError as e:
        print("without RVOD_TIMELINE:", e)
"""


@pytest.mark.timeout(30)
def test_timeline_calls_raise_as_in_horovod_when_not_initialized_or_not_enabled(job_env, tmp_path):
    env = {k: v for k, v in job_env.items() if "TIMELINE" not in k and not k.startswith(("RVOD_", "HOROVOD_"))}
    result = subprocess.run([sys.executable, "-c", ERRORS], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=25)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stderr
    assert lines.count("before init: rvod has not been initialized; use hvd.init().") == 2, lines
    assert lines.count("without RVOD_TIMELINE: Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.") == 2
    assert not (tmp_path / "t.json").exists()


def _steps_done(path):
    """The step count a loop worker last wrote to ``path`` (0 before its first write, or while it rewrites)."""
    try:
        text = path.read_text().strip()  # read once: the worker may truncate the file between two reads
    except FileNotFoundError:
        return 0
    return int(text) if text.isdigit() else 0


def start_loop(job_env, tmp_path, path):
    job_env["RVOD_TIMELINE"] = str(path)
    command = [sys.executable, "-m", "rvod.runner", "-np", "2", sys.executable, WORKER, "loop", str(tmp_path)]
    process = subprocess.Popen(command, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        steps = [_steps_done(tmp_path / f"steps{r}") for r in (0, 1)]
        if all(done >= 200 for done in steps) and _loop_ranks_on_disk(path) == {0, 1}:
            # Both ranks' writers have flushed batches (they flush every 0.1 s) and are mid-write.
            return process
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    kill_tagged(job_env[JOB_TAG_VARIABLE])
    pytest.fail("the loop did not get going: " + "\n".join(process.communicate()))


def _loop_ranks_on_disk(path: Path) -> set[int]:
    """The ranks whose loop allreduces are in the file so far (none while it is not there yet)."""
    try:
        trace = Trace(path)
    except (OSError, ValueError):
        return set()
    return set().union(*(trace.ranks(row) for row in trace.by_row if row.startswith("allreduce.loop.")))


def assert_loadable_with_both_ranks(path: Path):
    trace = Trace(path)  # json.loads must not fail
    ranks = set().union(*(trace.ranks(row) for row in trace.by_row if row.startswith("allreduce.loop.")))
    assert ranks == {0, 1}, ranks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "sigint"])
def test_valid_json_after_a_rank_is_killed_or_interrupted_mid_run(job_env, tmp_path, rank, sig):
    """kill -9 (or Ctrl-C's SIGINT, sent to the rank itself) of rank 0 or 1 while both ranks write."""
    path = tmp_path / "killed.json"
    process = start_loop(job_env, tmp_path, path)
    os.kill(int((tmp_path / f"pid{rank}").read_text()), sig)
    process.communicate(timeout=40)
    assert process.returncode != 0
    assert_loadable_with_both_ranks(path)


@pytest.mark.timeout(60)
def test_valid_json_after_ctrl_c_of_rvodrun(job_env, tmp_path):
    path = tmp_path / "interrupted.json"
    process = start_loop(job_env, tmp_path, path)
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=40)
    assert process.returncode != 0
    assert_loadable_with_both_ranks(path)
