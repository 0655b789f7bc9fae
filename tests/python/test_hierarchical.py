"""Jobs whose ranks span hosts, simulated on this machine: 4 ranks whose RVOD_HOSTNAME names two hosts, each
rank started with the environment rvodrun gives it for `-H hosta:2,hostb:2` or `-H hosta:1,hostb:3` (its
slot from rvod.runner.hosts, its variables from rvod.runner.worker_env). The engine tells hosts apart by
that name, so each "host"'s ranks share memory and the hosts talk TCP over loopback, as across machines
(and again over UCX, RVOD_TRANSPORT=ucx, where libucp can be loaded).

workers/hierarchical.py runs every rvod.numpy op x dtype on the global set and on sets spanning the hosts,
with the hierarchical algorithms forced on, forced off and left to the engine, and checks exact values,
identical bytes across the three, and Horovod's local/cross ranks and sizes. About 15 s per layout.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, FakeHostsJob, hierarchical_runs_by_phase, verdicts

import ucx_env


# Horovod's topology for each layout, by rank: local_rank, local_size, cross_rank, cross_size, is_homogeneous.
LAYOUTS = {
    "hosta:2,hostb:2": ["0,2,0,2,True", "1,2,0,2,True", "0,2,1,2,True", "1,2,1,2,True"],
    "hosta:1,hostb:3": ["0,1,0,2,False", "0,3,1,2,False", "1,3,0,1,False", "2,3,0,1,False"],
}


_UCX = pytest.mark.skipif(ucx_env.skip_reason() is not None, reason=ucx_env.skip_reason() or "")


# Every layout over TCP; over UCX the homogeneous one, where the hierarchical algorithms run (on 1+3 they never
# do; a lone rank's host over UCX is covered by test_multihost.py's every-op test on 1+3 namespace hosts).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("hosts, transport", [(hosts, "tcp") for hosts in LAYOUTS]
                         + [pytest.param("hosta:2,hostb:2", "ucx", marks=_UCX)])
def test_every_collective_across_fake_hosts_hierarchical_on_off_and_auto(job_env, tmp_path, hosts, transport):
    """Between the hosts over rvod's TCP, and over UCX (its TCP transport, see ucx_env)."""
    topology = LAYOUTS[hosts]
    between = {**ucx_env.SETTINGS, "RVOD_TEST_TRANSPORT_KIND": "shm+ucx"} if transport == "ucx" else {
        "RVOD_TRANSPORT": "tcp"}
    job = FakeHostsJob(hosts, job_env, 4, [sys.executable, str(WORKERS / "hierarchical.py")], tmp_path,
                       settings={"RVOD_LOG_LEVEL": "debug", "RVOD_TEST_TOPOLOGY": ";".join(topology), **between})
    with job:
        job.start()
        results = job.wait(timeout=150)
        report = job.report()
    stdout = "".join(f"[{r}]<stdout>:{line}\n" for r, res in results.items() for line in res.stdout.splitlines())
    found = verdicts(stdout)
    assert set(found) == {0, 1, 2, 3}, report
    assert all(failed == 0 for _, failed in found.values()), report
    assert all(res.returncode == 0 for res in results.values()), report
    # Ranks outside a spanning set run fewer checks; every rank runs the whole global matrix three times.
    assert min(passed for passed, _ in found.values()) > 3 * 300, report
    # Which algorithms ran, by phase, from rank 0's debug log: hierarchical ones only where the hosts have
    # the same number of ranks, always when forced on, never when forced off, for large buffers when unset.
    phases = hierarchical_runs_by_phase(results[0].stderr)
    assert list(phases) == ["forced on", "forced off", "engine's choice"], report
    if topology[0].endswith("False"):
        assert all(p["allreduce"] == p["allgather"] == 0 for p in phases.values()), phases
    else:
        assert phases["forced on"]["allreduce"] > 150 and phases["forced on"]["allgather"] > 10, phases
        assert phases["forced on"]["smallest"] < 64, phases
        assert phases["forced off"]["allreduce"] == phases["forced off"]["allgather"] == 0, phases
        assert 0 < phases["engine's choice"]["allreduce"] < phases["forced on"]["allreduce"], phases
        assert phases["engine's choice"]["smallest"] > 64 * 1024, phases
