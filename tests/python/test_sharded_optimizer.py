"""DistributedOptimizer(sharded=True): optimizer state sharded across ranks (issue 33).

workers/sharded_optimizer.py runs once on 4 ranks, with the process sets {0, 1} and {0, 1, 2} standing for
worlds of 2 and 3 ranks (many checks per job): 200 steps of Adam, AdamW and SGD with momentum on 2, 3 and
4 ranks equal a full-batch reference, each rank holds 1/N of the state, the options keep their meaning
(against the plain DistributedOptimizer), clip_grad_norm_, state dicts round-trip and consolidate, broadcasts, refusals, and
the shards saved by 4 ranks reshard into 2, then 3.
"""

from __future__ import annotations

import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("torch", reason="rvod.torch needs PyTorch (pip install torch) to be tested")

COMMON = 14  # the checks every rank runs; 9 more for each world (2, 3, 4 ranks) it belongs to
CHECKS = {0: COMMON + 27, 1: COMMON + 27, 2: COMMON + 18, 3: COMMON + 9}


@pytest.mark.timeout(240)
def test_sharded_equals_whole_batch_on_2_3_4_ranks_and_reshards_4_2_3(run_rvodrun, tmp_path):
    result = run_rvodrun(["-np", "4", sys.executable, str(WORKERS / "sharded_optimizer.py"), str(tmp_path)],
                         timeout=200)
    assert_worker_job(result, CHECKS)
