"""Metrics worker (2 ranks, started with rvodrun --metrics-port P): runs known collectives, then scrapes its
own endpoint and its peer's (P + local rank) and checks the Prometheus text: counters by kind, the fusion
histogram, cache hits, negotiation and collective time, engine starts, per-rank lateness; a path other than
/metrics is a 404."""

import os
import re
import urllib.error
import urllib.request

import numpy as np

import rvod.numpy as hvd
from _check import check, finish

hvd.init()
rank = hvd.rank()
port = int(os.environ["RVOD_METRICS_PORT"])
for step in range(20):
    handles = [hvd.allreduce_async(np.ones(256, np.float32), name=f"g{i}", op=hvd.Sum) for i in range(3)]
    for handle in handles:
        hvd.synchronize(handle)
hvd.broadcast(np.arange(8, dtype=np.int64), root_rank=0, name="b")
hvd.allgather(np.ones((2, 3)), name="ag")
hvd.barrier()


def scrape(local_rank, path="/metrics"):
    with urllib.request.urlopen(f"http://127.0.0.1:{port + local_rank}{path}", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4"), reply.headers
        return reply.read().decode()


def value(text, sample):
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert found, f"{sample} not in:\n{text}"
    return float(found.group(1))


text = scrape(rank)
with check("ops and bytes by kind"):
    assert value(text, 'rvod_ops_total{kind="allreduce"}') == 60
    assert value(text, 'rvod_bytes_total{kind="allreduce"}') == 60 * 256 * 4
    assert value(text, 'rvod_ops_total{kind="broadcast"}') == 1
    assert value(text, 'rvod_ops_total{kind="allgather"}') == 1
    assert value(text, 'rvod_ops_total{kind="alltoall"}') == 0
with check("fusion histogram, cache, times, starts"):
    assert value(text, 'rvod_fusion_buffer_bytes_bucket{le="+Inf"}') == value(text, "rvod_fusion_buffer_bytes_count")
    assert value(text, "rvod_fused_tensors_total") >= 2 * value(text, "rvod_fusion_buffer_bytes_count") > 0
    assert value(text, "rvod_response_cache_hits_total") >= 50
    assert 3 <= value(text, "rvod_response_cache_misses_total") <= 10
    assert value(text, "rvod_negotiation_seconds_total") > 0 and value(text, "rvod_collective_seconds_total") > 0
    assert value(text, "rvod_engine_starts_total") == 1 and value(text, "rvod_elastic_resets_total") == 0
    assert value(text, 'rvod_rank_straggler{rank="1"}') == 0 and value(text, 'rvod_rank_last_total{rank="0"}') >= 0
    assert "# TYPE rvod_fusion_buffer_bytes histogram" in text and "# TYPE rvod_ops_total counter" in text
with check("the peer's endpoint and a wrong path"):
    assert value(scrape(1 - rank), 'rvod_ops_total{kind="allreduce"}') == 60
    try:
        scrape(rank, "/other")
        raise AssertionError("no 404")
    except urllib.error.HTTPError as error:
        assert error.code == 404, error
hvd.barrier()
hvd.shutdown()
finish(rank)
