"""The chaos soak, short: elastic PyTorch training on 4 namespace hosts (5 ranks) survives at least 10 faults
of every kind (tests/python/chaos.py) injected within 5 minutes, with every invariant checked after each fault
and at the end. The long soak (>= 100 faults) is scripts/chaos-soak.sh; its report is in docs/chaos.md.

RVOD_CHAOS_FAULTS and RVOD_CHAOS_SEED change the number of faults and the seed (the long run sets them);
RVOD_CHAOS_REPORT names a JSON file for the summary.
"""

from __future__ import annotations

import json
import os

import pytest

import chaos
import netns

_REASON = netns.skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
FAULTS = int(os.environ.get("RVOD_CHAOS_FAULTS", "10"))
SEED = int(os.environ.get("RVOD_CHAOS_SEED", "20261129"))


@pytest.mark.timeout(600 + 60 * FAULTS)
def test_elastic_training_survives_faults_of_every_kind(job_env, tmp_path, shm_dir):
    cluster = netns.Cluster(["a", "b", "c", "d"])
    try:
        soak = chaos.Soak(cluster, job_env, tmp_path, shm_dir, SEED, {"a": 2, "b": 1, "c": 1, "d": 1})
        try:
            soak.run(FAULTS)
        finally:
            print(soak.describe())
        soak.finish()
        summary = soak.summary()
        print(json.dumps(summary))
        if os.environ.get("RVOD_CHAOS_REPORT"):
            with open(os.environ["RVOD_CHAOS_REPORT"], "w") as report:
                json.dump({**summary, "seed": SEED, "faults_detail": [f.__dict__ for f in soak.faults]}, report,
                          indent=1)
        assert summary["faults"] == FAULTS and summary["survived"] == FAULTS
        assert set(summary["by_kind"]) == set(chaos.FAULT_KINDS)
    finally:
        cluster.close()
