"""DistributedOptimizer(sharded=True): optimizer state sharded across ranks (issue 33).

workers/sharded_optimizer.py runs on 4, then 2, then 3 ranks (one job each, many checks per job): 200
steps of Adam, AdamW and SGD with momentum equal the plain DistributedOptimizer's, each rank holds 1/N of
the state, the options keep their meaning, state dicts round-trip and consolidate, broadcasts, refusals;
each job loads the shards the previous one saved, resharding 4 -> 2 -> 3.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("torch", reason="rvod.torch needs PyTorch (pip install torch) to be tested")

CHECKS = 22  # in a job that loads no previous job's shards; one more when it does


@pytest.mark.timeout(420)
def test_sharded_equals_plain_and_reshards_4_2_3(run_rvodrun, tmp_path):
    previous = []
    for size in (4, 2, 3):
        result = run_rvodrun(["-np", str(size), sys.executable, str(WORKERS / "sharded_optimizer.py"), str(tmp_path),
                              *previous], timeout=130)
        assert_worker_job(result, {rank: CHECKS + (1 if previous else 0) for rank in range(size)})
        previous = [str(size)]
