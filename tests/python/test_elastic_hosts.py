"""Elastic training across separate machines: hosts a, b and c are network namespaces with an sshd each
(tests/python/netns.py), and rvodrun runs in the test-made launcher namespace, reaching them over ssh, with
the PyTorch workers of test_elastic.py (workers/elastic_torch.py): losing a host, gaining one, and both in one
job with the links between hosts over UCX (where libucp can be loaded). Skipped, with the reason, where network
namespaces cannot be made (not root, no sshd).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_elastic import (WORKER, ElasticJob, assert_every_sample_once_per_epoch, assert_worlds_start_in_step,
                          read)

import netns
import ucx_env

_REASON = netns.skip_reason()
_UCX_REASON = ucx_env.skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture(scope="module")
def cluster():
    cluster = netns.Cluster(["a", "b", "c"])
    try:
        yield cluster
    finally:
        cluster.close()


def worker_pids(cluster: netns.Cluster, host: str) -> list[int]:
    """The elastic workers (workers/elastic_torch.py) running in host `host`'s namespace."""
    found = []
    for pid in cluster.pids(host):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(WORKER).encode() in arguments:
            found.append(pid)
    return found


@pytest.mark.timeout(300)
def test_kill_9_of_a_worker_on_one_host_training_goes_on_on_the_others(job_env, cluster, tmp_path):
    """kill -9, from outside, of the worker on host b (rank 1 of 3) in the middle of epoch 1: the workers on
    a and c restore the last commit, form a world of 2 and finish; the new world starts from rank 0's last
    commit, every sample of every epoch is counted exactly once, and both end with the same parameters.
    Nothing is left running on any host."""
    job = ElasticJob(cluster.env(job_env), tmp_path, "a:1\nb:1\nc:1\n", ["--min-np", "2"], wrap=cluster.launch_args,
                     ELASTIC_SAMPLES="48", ELASTIC_EPOCHS="4", ELASTIC_STEP_SECONDS="0.2")
    job.wait_for("progress.jsonl", lambda entry: entry["epoch"] == 1 and entry["batch"] >= 2, 180)
    deadline = time.monotonic() + 10
    while not (pids := worker_pids(cluster, "b")):
        assert time.monotonic() < deadline, f"no worker process on host b: {cluster.stray_processes()}"
        time.sleep(0.05)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.time()
    assert job.finish(200) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 4, 48)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2], job.report()
    assert sorted(s["host"] for s in worlds[1]) == ["a", "b", "c"]
    assert sorted((s["rank"], s["host"]) for s in worlds[2]) == [(0, "a"), (1, "c")]
    # Rank 0 writes a progress line just before each commit (its save cannot fail), so its last one in world 1
    # is the commit that world 2 starts from.
    committed = [p for p in read(tmp_path, "progress.jsonl") if p["round"] == 1][-1]
    assert (worlds[2][0]["epoch"], worlds[2][0]["batch"]) == (committed["epoch"], committed["batch"]), job.report()
    assert sorted(r["round"] for r in read(tmp_path, "restores.jsonl")) == [1, 1]
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 2 and len({d["params"] for d in done}) == 1
    assert "worker 2 (rank 1 on b) was killed by signal SIGKILL; host b is blacklisted" in job.stderr, job.report()
    assert "world 2 (failure): 2 ranks on a, c" in job.stderr
    print(f"death to training resumed across hosts: {min(s['time'] for s in worlds[2]) - killed_at:.2f} s")
    assert cluster.wait_until_empty() == {}


@pytest.mark.timeout(300)
def test_host_appearing_grows_the_job_onto_it_from_the_committed_state(job_env, cluster, tmp_path):
    """The discovery script adds host c to a job on a and b: the job grows to 3 ranks, the worker started
    on c over ssh begins with the committed parameters, epoch and batch of the others, nothing is restored,
    and every sample of every epoch is still counted once."""
    job = ElasticJob(cluster.env(job_env), tmp_path, "a:1\nb:1\n", ["--min-np", "2", "--max-np", "3"],
                     wrap=cluster.launch_args, ELASTIC_SAMPLES="48", ELASTIC_EPOCHS="4", ELASTIC_STEP_SECONDS="0.2")
    job.wait_for("progress.jsonl", lambda entry: entry["batch"] >= 2, 180)
    job.set_hosts("a:1\nb:1\nc:1\n")
    assert job.finish(200) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 4, 48)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2], job.report()
    assert sorted((s["rank"], s["host"]) for s in worlds[2]) == [(0, "a"), (1, "b"), (2, "c")]
    committed = [p for p in read(tmp_path, "progress.jsonl") if p["round"] == 1][-1]
    assert (worlds[2][0]["epoch"], worlds[2][0]["batch"]) == (committed["epoch"], committed["batch"])
    assert not read(tmp_path, "restores.jsonl")
    assert "world 2 (added): 3 ranks on a, b, c; 1 started" in job.stderr, job.report()
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 3 and len({d["params"] for d in done}) == 1
    assert cluster.wait_until_empty() == {}


@pytest.mark.skipif(_UCX_REASON is not None, reason=_UCX_REASON or "")
@pytest.mark.timeout(300)
def test_over_ucx_a_host_gained_then_a_host_lost(job_env, cluster, tmp_path):
    """Both re-formings with the links between hosts over UCX (its TCP transport, see ucx_env): the job on a
    and b grows onto c when discovery adds it, then rank 1 (on b) of that world kills itself with SIGKILL and
    the workers on a and c go on from the last commit; every world connects over UCX, every sample of every
    epoch is counted once, and nothing is left running."""
    env = cluster.env(job_env)
    env.update(UCX_TLS=ucx_env.SETTINGS["UCX_TLS"])
    job = ElasticJob(env, tmp_path, "a:1\nb:1\n", ["--transport", "ucx", "--verbose", "--min-np", "2", "--max-np", "3"],
                     wrap=cluster.launch_args, ELASTIC_SAMPLES="24", ELASTIC_EPOCHS="3", ELASTIC_STEP_SECONDS="0.2",
                     ELASTIC_KILL="2:1:4")
    job.wait_for("progress.jsonl", lambda entry: entry["batch"] >= 2, 180)
    job.set_hosts("a:1\nb:1\nc:1\n")
    assert job.finish(200) == 0, job.report()
    assert_every_sample_once_per_epoch(tmp_path, 3, 24)
    worlds = assert_worlds_start_in_step(tmp_path)
    assert sorted(worlds) == [1, 2, 3], job.report()
    assert sorted((s["rank"], s["host"]) for s in worlds[2]) == [(0, "a"), (1, "b"), (2, "c")]
    assert sorted((s["rank"], s["host"]) for s in worlds[3]) == [(0, "a"), (1, "c")]
    assert [(k["round"], k["rank"]) for k in read(tmp_path, "kills.jsonl")] == [(2, 1)]
    assert "world 2 (added): 3 ranks on a, b, c; 1 started" in job.stderr, job.report()
    assert re.search(r"rank 1 on b\) was killed by signal SIGKILL; host b is blacklisted", job.stderr), job.report()
    assert "world 3 (failure): 2 ranks on a, c" in job.stderr, job.report()
    # Rank 0's log line in each of the three worlds (rvodrun --verbose puts the ranks' log at INFO).
    assert len(re.findall(r"rank 0: between hosts through UCX \S+ from \S+ \(RVOD_TRANSPORT=ucx\)", job.stderr)) == 3, \
        job.report()
    done = read(tmp_path, "done.jsonl")
    assert len(done) == 2 and len({d["params"] for d in done}) == 1
    assert cluster.wait_until_empty() == {}
