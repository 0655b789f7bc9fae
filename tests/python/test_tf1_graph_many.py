"""Any number of collectives in one Session.run of a tf.compat.v1 graph, 2 ranks through rvodrun, one job:
workers/tf1_graph_many.py fetches 1, 8, 16, 64 and 256 allreduces and allgathers together, in a plain
Session and with inter_op_parallelism_threads=1 and 2, and checks every value (each collective used to hold
an inter-op thread while waiting, so this deadlocked past the Session's thread count); then a collective one
rank submits late, which rank 0's stall inspector must name. A hang makes the ranks print their stacks and
exit. About a minute on 2 busy cores."""

from __future__ import annotations

import re
import sys

import pytest
from jobs import WORKERS, assert_worker_job

pytest.importorskip("tensorflow", reason="rvod.tensorflow needs TensorFlow (pip install .[tensorflow]) to be tested")


@pytest.mark.timeout(240)
def test_any_number_of_collectives_in_one_session_run(run_rvodrun, job_env):
    job_env["RVOD_STALL_CHECK_TIME_SECONDS"] = "2"
    result = run_rvodrun(["-np", "2", sys.executable, str(WORKERS / "tf1_graph_many.py"), "180"], timeout=220)
    assert_worker_job(result, {0: 16, 1: 16})

    # The stall warning: logged by rank 0 (the coordinator), naming the late tensor and rank 1 only (on a busy
    # machine a Session's first run of 256 collectives may also outlast the 2 s on one rank: other warnings).
    coordinator = "\n".join(re.findall(r"^\[0\]<stderr>:(.*)$", result.stderr, re.MULTILINE))
    assert re.search(r"waiting for remainder of ranks for more than \d+ seconds", coordinator), result.stderr
    missing = [rank for rank, names in re.findall(r"^(\d+)!?: \[(.*)\]$", coordinator, re.MULTILINE)
               if "tf1.stall" in names]
    assert missing and set(missing) == {"1"}, coordinator
