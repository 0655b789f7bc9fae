"""Result memory (src/memory.rs): large out-of-place results come from a bounded pool of mappings that
the next result of the same size reuses, and that is given back to the system once the job stops
communicating. Measured through the ranks' resident memory (VmRSS), on 2 ranks; about 15 s."""

from __future__ import annotations

import re
import sys

import pytest

WORKER = r"""
import time
import numpy as np
import rvod.numpy as hvd

def rss_mib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024

hvd.init()
x = np.ones(16 << 20, np.float32)  # 64 MiB
hvd.allreduce(x, op=hvd.Sum, name="warm")
start = rss_mib()
for step in range(20):
    y = hvd.allreduce(x, op=hvd.Sum, name="big")
    assert y[0] == hvd.size() and y[-1] == hvd.size()
    gathered = hvd.allgather(x[: 1 << 20], name="gathered")
    assert gathered.shape == (hvd.size() << 20,)
busy = rss_mib()
del y, gathered
time.sleep(5)  # longer than memory::IDLE (3 s) plus the engine's idle wake-up (1 s)
idle = rss_mib()
print(f"rank {hvd.rank()}: start {start:.0f} busy {busy:.0f} idle {idle:.0f} MiB", flush=True)
hvd.shutdown()
"""
LINE = re.compile(r"rank (\d): start (\d+) busy (\d+) idle (\d+) MiB")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool_mb", ["256", "0"])
def test_results_reuse_bounded_memory_and_give_it_back_when_idle(run_rvodrun, job_env, pool_mb):
    job_env["RVOD_BUFFER_POOL_MB"] = pool_mb
    result = run_rvodrun(["-np", "2", sys.executable, "-c", WORKER], timeout=80)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    assert result.returncode == 0, report
    found = {int(m.group(1)): tuple(map(int, m.groups()[1:])) for m in LINE.finditer(result.stdout)}
    assert set(found) == {0, 1}, report
    for start, busy, idle in found.values():
        # 20 results of 64 MiB: reused, so the ranks hold at most a few of them, not 20.
        assert busy - start < 300, report
        # Idle: the pool is empty again, so the ranks hold about what they held before the loop, or less.
        assert idle < start + 40, report
