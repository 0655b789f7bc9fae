"""Adasum on 4 ranks spread over two fake hosts (as in test_hierarchical.py: RVOD_HOSTNAME differs, so each
"host"'s ranks share memory and the hosts talk TCP over loopback). workers/adasum_hosts.py checks rvod.numpy
Adasum against a NumPy reference: on 2+2 ranks, the Adasum across hosts of the host averages (Horovod's GPU
variant) unless hierarchical allreduce is off, then the flat order; on uneven 1+3 ranks always the flat
order. The 2+2 layout runs again with the hosts talking over UCX (its TCP transport, see ucx_env), where
libucp can be loaded. About 8 s per case (16 s measured for both layouts on the shared 2-core VM).
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, FakeHostsJob, verdicts

import ucx_env

_UCX_REASON = ucx_env.skip_reason()
LAYOUTS = {"hosta:2,hostb:2": "0,0,1,1", "hosta:1,hostb:3": "0,1,1,1"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts, transport", [
    ("hosta:2,hostb:2", "tcp"),
    ("hosta:1,hostb:3", "tcp"),
    pytest.param("hosta:2,hostb:2", "ucx", marks=pytest.mark.skipif(_UCX_REASON is not None, reason=_UCX_REASON or "")),
])
def test_adasum_across_fake_hosts_matches_the_reference(job_env, tmp_path, hosts, transport):
    between = ucx_env.SETTINGS if transport == "ucx" else {"RVOD_TRANSPORT": "tcp"}
    job = FakeHostsJob(hosts, job_env, 4, [sys.executable, str(WORKERS / "adasum_hosts.py")], tmp_path,
                       settings={"RVOD_LOG_LEVEL": "debug", **between})
    with job:
        job.base_env["RVOD_TEST_LAYOUT"] = LAYOUTS[hosts]
        job.start(list(range(4)))
        results = job.wait(timeout=100)
        report = job.report()
    stdout = "".join(f"[{r}]<stdout>:{line}\n" for r, res in results.items() for line in res.stdout.splitlines())
    found = verdicts(stdout)
    assert set(found) == {0, 1, 2, 3}, report
    assert all(failed == 0 for _, failed in found.values()), report
    assert all(passed >= 2 * 10 for passed, _ in found.values()), report
    assert all(res.returncode == 0 for res in results.values()), report
    assert f"rank 0: between hosts through {transport.upper()}" in results[0].stderr, report
    # Rank 0's debug log: the hierarchical Adasum ran in the first phase only, and only on even hosts.
    first, _, second = results[0].stderr.partition("PHASE forced off")
    even = LAYOUTS[hosts] == "0,0,1,1"
    assert ("hierarchical adasum of" in first) == even, report
    assert "hierarchical adasum of" not in second, report
