"""Jobs whose ranks span hosts, simulated on this machine: 4 ranks whose RVOD_HOSTNAME names two hosts, each
rank started with the environment rvodrun gives it for `-H hosta:2,hostb:2` or `-H hosta:1,hostb:3` (its
slot from rvod.runner.hosts, its variables from rvod.runner.worker_env). The engine tells hosts apart by
that name, so each "host"'s ranks share memory and the hosts talk TCP over loopback, as across machines.

workers/hierarchical.py runs every rvod.numpy op x dtype on the global set and on sets spanning the hosts,
with the hierarchical algorithms forced on, forced off and left to the engine, and checks exact values,
identical bytes across the three, and Horovod's local/cross ranks and sizes. About 15 s per layout.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, LocalJob, verdicts

from rvod.runner.hosts import assign_slots, parse_hosts
from rvod.runner.worker_env import worker_env

# Horovod's topology for each layout, by rank: local_rank, local_size, cross_rank, cross_size, is_homogeneous.
LAYOUTS = {
    "hosta:2,hostb:2": ["0,2,0,2,True", "1,2,0,2,True", "0,2,1,2,True", "1,2,1,2,True"],
    "hosta:1,hostb:3": ["0,1,0,2,False", "0,3,1,2,False", "1,3,0,1,False", "2,3,0,1,False"],
}


class FakeHostsJob(LocalJob):
    """A LocalJob whose ranks get rvodrun's environment for `hosts` (host names are only names here)."""

    def __init__(self, hosts: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = assign_slots(parse_hosts(hosts), self.size)

    def env_for(self, rank: int) -> dict[str, str]:
        return worker_env(self.base_env, self.slots[rank], rendezvous_addr="127.0.0.1", rendezvous_port=self.port,
                          secret=self.secret, settings={})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hosts", list(LAYOUTS))
def test_every_collective_across_fake_hosts_hierarchical_on_off_and_auto(job_env, tmp_path, hosts):
    topology = LAYOUTS[hosts]
    job = FakeHostsJob(hosts, job_env, 4, [sys.executable, str(WORKERS / "hierarchical.py")], tmp_path)
    with job:
        for rank in range(4):
            job.base_env["RVOD_TEST_TOPOLOGY"] = topology[rank]
            job.start([rank])
        results = job.wait(timeout=150)
        report = job.report()
    stdout = "".join(f"[{r}]<stdout>:{line}\n" for r, res in results.items() for line in res.stdout.splitlines())
    found = verdicts(stdout)
    assert set(found) == {0, 1, 2, 3}, report
    assert all(failed == 0 for _, failed in found.values()), report
    assert all(res.returncode == 0 for res in results.values()), report
    # Ranks outside a spanning set run fewer checks; every rank runs the whole global matrix three times.
    assert min(passed for passed, _ in found.values()) > 3 * 300, report
