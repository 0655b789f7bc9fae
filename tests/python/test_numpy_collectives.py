"""Multi-process tests of what rvod.numpy does beyond the collective cases (test_collectives.py runs every
op x dtype x variant of every shim), run through rvodrun with 2 and 3 ranks, over shared memory (the
default on one host) and over TCP (RVOD_SHM=0).

One job per job size runs workers/collectives.py, which reports each failing check by name; see that script
for what is covered.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, failures, verdicts

CHECKS = 32  # the `check` blocks workers/collectives.py runs, those of its two re-init phases twice


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [2, 3])
def test_numpy_specifics_join_cache_and_fusion(run_rvodrun, job_env, size, transport):
    job_env.update(RVOD_SHM="1" if transport == "shm" else "0", RVOD_TEST_TRANSPORT=transport)
    result = run_rvodrun(["-np", str(size), sys.executable, str(WORKERS / "collectives.py")], timeout=120)
    found = verdicts(result.stdout)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{failures(result.stderr)[-20000:]}"
    assert set(found) == set(range(size)), report
    assert all(failed == 0 for _, failed in found.values()), report
    assert result.returncode == 0, report
    # Every rank ran every check (a worker that silently skipped a section would show up here).
    assert found == {rank: (CHECKS, 0) for rank in range(size)}, report
    # The last phase sets the cache capacity through its Horovod alias, HOROVOD_CACHE_CAPACITY=2; the
    # engine's (Horovod-worded) eviction warning shows that the alias was read.
    assert "raising the capacity above 2 " in result.stderr, result.stderr[-3000:]
