"""Autotune on 2 ranks under rvodrun (RVOD_AUTOTUNE and rvodrun's --autotune* flags): the log's columns
and closing line, every rank applying the same values after the same round, allreduce results exact while
the knobs change, and a fusion threshold the user set staying fixed; on 4 ranks across two fake hosts, the
sweep of the hierarchical algorithms; the private hook `_rvod._set_tuned_values` (benches/autotune.py's) applying
values set by hand on every rank after the same round. Worker: workers/autotune.py.
About 13 s in all."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from jobs import WORKERS

WORKER = str(WORKERS / "autotune.py")
COLUMNS = ["sample", "phase", "fusion_threshold_bytes", "cycle_time_ms", "cache_enabled", "hierarchical_allreduce",
           "hierarchical_allgather", "steps", "bytes", "seconds", "score_bytes_per_s", "chosen_because", "next"]
# 1 warm-up, the defaults, 5 more Bayesian samples (6 with the defaults), then the sweep: a baseline at the
# best point, the defaults again (unless they are the best point) and the cache toggled.
SAMPLE_FLAGS = ["--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "3",
                "--autotune-bayes-opt-max-samples", "6"]
TUNING_PHASES = ["warm-up", "defaults"] + ["bayes"] * 5
STEPS = 80


def run_job(run_rvodrun, tmp_path, extra_flags=()):
    log = tmp_path / "autotune.csv"
    result = run_rvodrun(["-np", "2", "--autotune", "--autotune-log-file", str(log), *SAMPLE_FLAGS, *extra_flags,
                          sys.executable, WORKER, str(tmp_path), str(STEPS)], timeout=100)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    lines = log.read_text().splitlines()
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    return lines, rows, ranks


def assert_phases_and_sweep(rows, default_fusion):
    """The phases in order, and the sweep's steps with their reasons; returns the sweep's rows."""
    phases = [row["phase"] for row in rows]
    assert phases[:len(TUNING_PHASES)] == TUNING_PHASES, phases
    sweep = rows[len(TUNING_PHASES):]
    reasons = [row["chosen_because"] for row in sweep]
    if reasons[-2:] == ["categorical sweep: the best values again before the flip is kept",
                        "categorical sweep: the flip again to confirm it"]:
        # The cache toggled won its sample: measured again next to the best values (the manager's Confirm).
        assert sweep[-2]["cache_enabled"] == "true" and sweep[-1]["cache_enabled"] == "false", sweep
        sweep, reasons = sweep[:-2], reasons[:-2]
    assert [row["phase"] for row in sweep] == ["categorical"] * len(sweep) and len(sweep) in (2, 3), phases
    assert reasons[0] == "categorical sweep: baseline at the best fusion threshold and cycle time", reasons
    assert reasons[-1] == "categorical sweep: response cache toggled", reasons
    if len(sweep) == 3:
        assert reasons[1] == "categorical sweep: the defaults again for comparison", reasons
        assert (sweep[1]["fusion_threshold_bytes"], sweep[1]["cycle_time_ms"], sweep[1]["cache_enabled"]) == \
            (str(default_fusion), "1.000", "true")
    assert sweep[0]["cache_enabled"] == "true" and sweep[-1]["cache_enabled"] == "false"
    return sweep


def as_row_values(applied):
    return (str(applied["fusion_threshold"]), f"{applied['cycle_time_ms']:.3f}", str(applied["cache_enabled"]).lower())


@pytest.mark.timeout(120)
def test_autotune_logs_each_sample_and_every_rank_applies_the_same_values(run_rvodrun, tmp_path):
    lines, rows, ranks = run_job(run_rvodrun, tmp_path)
    assert lines[0].split(",") == COLUMNS
    assert_phases_and_sweep(rows, 64 << 20)
    assert [int(row["sample"]) for row in rows] == list(range(len(rows)))
    assert all(row["steps"] == "3" and float(row["score_bytes_per_s"]) > 0 and int(row["bytes"]) > 0
               for row in rows), rows
    assert rows[2]["chosen_because"] == "initial probe 1 of 4"
    assert rows[6]["chosen_because"].startswith("largest expected improvement: "), rows[6]
    assert all(row["next"] == following["chosen_because"] for row, following in zip(rows, rows[1:]))
    best = lines[-1]
    assert best.startswith("# best: fusion_threshold_bytes=") and "improvement_over_defaults=" in best, best

    # Lockstep: both ranks applied the same values after the same rounds; results were exact throughout.
    assert ranks[0]["wrong"] == [] and ranks[1]["wrong"] == [], ranks
    applied = ranks[0]["applied"]
    assert applied == ranks[1]["applied"]
    rounds = [a["round"] for a in applied]
    assert rounds == sorted(set(rounds)) and rounds[0] >= 1, rounds
    # The defaults first, with the 128 MiB default capped to the 2-rank staging area (64 MiB).
    assert applied[0]["fusion_threshold"] == 64 << 20 and applied[0]["cycle_time_ms"] == pytest.approx(1.0)
    assert all(a["fusion_threshold"] <= 64 << 20 for a in applied)
    assert all(a["hierarchical_allreduce"] is None and a["hierarchical_allgather"] is None for a in applied)
    # Every sample measured values some rank applied, and the last values applied are the best ones.
    tried = {as_row_values(a) for a in applied}
    assert all((row["fusion_threshold_bytes"], row["cycle_time_ms"], row["cache_enabled"]) in tried for row in rows)
    final = applied[-1]
    assert best.startswith(f"# best: fusion_threshold_bytes={final['fusion_threshold']} "
                           f"cycle_time_ms={final['cycle_time_ms']:.3f} "
                           f"cache_enabled={str(final['cache_enabled']).lower()} "), (best, final)


@pytest.mark.timeout(120)
def test_a_fusion_threshold_the_user_set_is_not_tuned(run_rvodrun, tmp_path):
    lines, rows, ranks = run_job(run_rvodrun, tmp_path, ["--fusion-threshold-mb", "1"])
    assert_phases_and_sweep(rows, 1 << 20)
    assert {row["fusion_threshold_bytes"] for row in rows} == {str(1 << 20)}
    assert len({row["cycle_time_ms"] for row in rows}) > 2, "the cycle time is still tuned"
    assert ranks[0]["wrong"] == [] and ranks[1]["wrong"] == []
    assert ranks[0]["applied"] == ranks[1]["applied"]
    assert {a["fusion_threshold"] for a in ranks[0]["applied"]} == {1 << 20}
    assert lines[-1].startswith(f"# best: fusion_threshold_bytes={1 << 20} "), lines[-1]


@pytest.mark.timeout(150)
def test_across_hosts_the_sweep_tries_the_hierarchical_algorithms(job_env, tmp_path):
    """4 ranks on two fake hosts (see test_hierarchical.py): the categorical sweep flips hierarchical
    allreduce and allgather on and off, every rank applies each flip after the same round, results stay exact."""
    from test_hierarchical import FakeHostsJob

    out = tmp_path / "applied"
    out.mkdir()
    log = tmp_path / "autotune.csv"
    settings = {"RVOD_AUTOTUNE": "1", "RVOD_AUTOTUNE_LOG": str(log), "RVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                "RVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3", "RVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "2"}
    job = FakeHostsJob("hosta:2,hostb:2", job_env, 4, [sys.executable, WORKER, str(out), str(STEPS)], tmp_path,
                       settings=settings)
    with job:
        job.start()
        results = job.wait(timeout=130)
        report = job.report()
    assert all(res.returncode == 0 for res in results.values()), report
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(rank["wrong"] == [] for rank in ranks), ranks
    assert all(rank["applied"] == ranks[0]["applied"] for rank in ranks)
    rows = list(csv.DictReader(line for line in log.read_text().splitlines() if not line.startswith("#")))
    reasons = [row["chosen_because"] for row in rows]
    for flip in ("hierarchical allreduce true", "hierarchical allreduce false", "hierarchical allgather true",
                 "hierarchical allgather false"):
        assert f"categorical sweep: {flip}" in reasons, reasons
    assert {row["hierarchical_allreduce"] for row in rows} == {"auto", "true", "false"}, rows
    assert {a["hierarchical_allreduce"] for a in ranks[0]["applied"]} >= {True, False}
    assert log.read_text().splitlines()[-1].startswith("# best: "), log.read_text()


@pytest.mark.timeout(90)
def test_values_set_by_hand_apply_on_every_rank_after_the_same_round(run_rvodrun, tmp_path):
    """The private hook benches/autotune.py uses to compare settings in one job (autotune off here): each
    setting rank 0 asks for is applied by both ranks after the same round, before the step after the one it
    was asked at is done (rank 1's different requests are ignored), and results stay exact."""
    result = run_rvodrun(["-np", "2", sys.executable, WORKER, str(tmp_path), "4", "by-hand"], timeout=80)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["wrong"] == [] and ranks[1]["wrong"] == [], ranks
    applied = ranks[0]["applied"]
    assert applied == ranks[1]["applied"], ranks
    assert [(a["fusion_threshold"], round(a["cycle_time_ms"], 3), a["cache_enabled"]) for a in applied] == \
        [(1 << 20, 0.2, True), (0, 5.0, False), (64 << 20, 1.0, True)], applied
    assert all(a["hierarchical_allreduce"] is None and a["hierarchical_allgather"] is None for a in applied)
    rounds = [a["round"] for a in applied]
    assert rounds == sorted(set(rounds)) and rounds[0] >= 1, rounds
    # After setting k's second step every rank has applied k + 1 sets of values (the first step's collectives
    # complete in the round that carries them, or in a later one).
    for rank in ranks:
        assert rank["seen"][1::2] == [1, 2, 3], rank["seen"]
    assert all(len(rank["errors"]) == 3 and all("cycle_time_ms" in e for e in rank["errors"]) for rank in ranks)
