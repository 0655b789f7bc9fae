"""Scale worker (issue 32, proof by running): one rank of a 16-64 rank job on this host. Every op on a few
dtypes with exact results; then what scales, read from the rank's own metrics endpoint (RVOD_METRICS_PORT
+ local rank) and /proc: control messages per steady-state negotiation round, set-up time, memory (private,
and the host's shared-memory segment as mapped by this rank) and open sockets (after set-up, after every op but
alltoall, and after alltoall, which is the one op that talks to every peer).
Prints one `SCALE {...}` line per rank for the test to compare across job sizes."""

import json
import math
import os
import re
import time
import urllib.request

import numpy as np

started = time.monotonic()
import rvod.numpy as hvd  # noqa: E402
from _check import check, finish, say  # noqa: E402

init_started, init_cpu_started = time.monotonic(), time.process_time()
hvd.init()
init_s, init_cpu_s = time.monotonic() - init_started, time.process_time() - init_cpu_started
setup_s = time.monotonic() - started


def open_sockets():
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


sockets_at_setup = open_sockets()
R, N = hvd.rank(), hvd.size()

with check("allreduce: sum, min, max on float32, float64, int32, int64"):
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        x = np.arange(37, dtype=dtype) + R
        total = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{np.dtype(dtype).name}")
        assert total.dtype == dtype and np.array_equal(total, np.arange(37, dtype=dtype) * N + N * (N - 1) // 2)
        assert np.array_equal(hvd.allreduce(x, op=hvd.Min, name=f"min.{np.dtype(dtype).name}"), np.arange(37) + 0)
        assert np.array_equal(hvd.allreduce(x, op=hvd.Max, name=f"max.{np.dtype(dtype).name}"), np.arange(37) + N - 1)
    big = hvd.allreduce(np.full(300_001, R, np.float32), op=hvd.Sum, name="large")
    assert np.all(big == N * (N - 1) / 2), big[:4]
with check("allgather with uneven rows, broadcast from the last rank, reducescatter, barrier"):
    rows = hvd.allgather(np.full((R % 3, 2), R, np.int32), name="rows")
    expected = np.concatenate([np.full((r % 3, 2), r, np.int32) for r in range(N)])
    assert rows.shape == expected.shape and np.array_equal(rows, expected)
    b = hvd.broadcast(np.arange(5, dtype=np.float64) * (R + 1), root_rank=N - 1, name="bcast")
    assert np.array_equal(b, np.arange(5, dtype=np.float64) * N)
    part = hvd.reducescatter(np.ones(2 * N, np.float32), op=hvd.Sum, name="rs")
    assert part.shape == (2,) and np.all(part == N)
    hvd.barrier()

# Steady state: the same small allreduce, cached, many times; its control messages per round are read from
# this rank's metrics where it serves them on loopback (jobs on one host; across hosts they listen on the
# host's address, and the test counts them on one host).
metrics_port = os.environ.get("RVOD_METRICS_PORT")


def scrape():
    url = f"http://127.0.0.1:{int(metrics_port) + hvd.local_rank()}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {name: float(value) for name, value in re.findall(r"^(rvod_negotiation_\w+_total) (\S+)$", text, re.M)}


hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name="steady")  # the coordinator's round: cached from now on
before = scrape() if metrics_port else None
for step in range(30):
    hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name="steady")
per_round = None
if metrics_port:
    after = scrape()
    rounds = after["rvod_negotiation_rounds_total"] - before["rvod_negotiation_rounds_total"]
    messages = after["rvod_negotiation_messages_total"] - before["rvod_negotiation_messages_total"]
    with check("steady-state rounds send O(log N) control messages"):
        assert rounds >= 30, rounds
        per_round = round(messages / rounds, 3)
        bound = math.floor(math.log2(N)) + (0 if N & (N - 1) == 0 else 2)
        # A round in flight at either scrape may have its messages counted and not its end, or the reverse,
        # and the window may take in one uncached round (its gather and broadcast messages on top); CI once
        # saw 137 messages in 33 rounds at 16 ranks, one over 4 x 34. All-to-all would send 15 a round.
        assert messages <= bound * (rounds + 2), f"{messages} control messages in {rounds} rounds at {N} ranks"

status = open("/proc/self/status").read()


def status_mb(field):
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 1024


sockets = open_sockets()
with check("alltoall"):
    sent = np.arange(N, dtype=np.int64) + 1000 * R
    got = hvd.alltoall(sent, name="a2a")
    assert np.array_equal(got, np.arange(N, dtype=np.int64) * 1000 + R)
sockets_after_alltoall = open_sockets()
say("SCALE " + json.dumps({"rank": R, "size": N, "setup_s": round(setup_s, 3), "init_s": round(init_s, 3),
                           "init_cpu_s": round(init_cpu_s, 4), "private_mb": round(status_mb("RssAnon"), 1),
                           "shared_memory_mb": round(status_mb("RssShmem"), 1),
                           "sockets_at_setup": sockets_at_setup, "sockets": sockets,
                           "sockets_after_alltoall": sockets_after_alltoall, "messages_per_round": per_round}))
finish(R)
