"""Prometheus metrics (issue 37 item 4): `rvodrun --metrics-port P` makes each rank serve its metrics at
http://127.0.0.1:P+local_rank/metrics; a 2-rank job scrapes itself and its peer during the run
(tests/python/workers/metrics.py). A bad port is refused by name. The text format and every family are
unit-tested in src/engine/metrics.rs."""

import socket
import subprocess
import sys

import pytest
from jobs import WORKERS, assert_worker_job


def free_port_pair() -> int:
    """A port P such that P and P + 1 are free on loopback now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


@pytest.mark.timeout(90)
def test_each_rank_serves_its_metrics_and_a_scrape_reads_them(run_rvodrun):
    port = free_port_pair()
    result = run_rvodrun(["-np", "2", "--metrics-port", str(port), sys.executable, str(WORKERS / "metrics.py")],
                         timeout=80)
    assert_worker_job(result, {0: 3, 1: 3})


BAD_PORT_JOB = """
import rvod.numpy as hvd
try:
    hvd.init()
except ValueError as error:
    print("ValueError", error)
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_a_bad_metrics_port_is_refused_naming_it(job_env, port):
    run = subprocess.run([sys.executable, "-c", BAD_PORT_JOB], env={**job_env, "RVOD_METRICS_PORT": port},
                         capture_output=True, text=True, timeout=25)
    assert run.stdout.startswith("ValueError") and "RVOD_METRICS_PORT" in run.stdout, run
    assert "expected a port number in 1..65535" in run.stdout, run
