"""``reducescatter_async(..., output=)``: the engine writes this rank's block straight into memory the caller
gives (the sharded optimizer's gradient buffer) instead of a new tensor. Exact values against the plain
reducescatter on 2 ranks (the pipelined exchange), 3 (the staging areas, a burst fused there) and 3 over
TCP (the ring, small tensors fused), outputs that are neighbouring views of one buffer (nothing written
outside each), torch and NumPy; and refusals that name the problem before anything is sent (size, dtype, a
non-contiguous output, an output sharing the input's memory)."""

from __future__ import annotations

import sys

import pytest
from jobs import assert_worker_job

WORKER = r"""
import numpy as np
import torch
import rvod.torch as hvd
import rvod.numpy as hnp

hvd.init()
rank, size = hvd.rank(), hvd.size()
checks = 0

def block(n):
    return n // size + (rank < n % size)

# A burst of large and small tensors (rows of 3), each reduced into a view of one flat buffer with a sentinel
# between neighbours: every block lands in its own view, and nothing outside the views is written.
for dtype in (torch.float32, torch.int32):
    rows = [(1 << 20) + 5, 7, (1 << 19) + 1, 1, size - 1]
    inputs = [((torch.arange(r * 3) * 7 + rank * 5 + i) % 23).to(dtype).reshape(r, 3) for i, r in enumerate(rows)]
    sizes = [block(r) * 3 for r in rows]
    flat = torch.full((sum(sizes) + len(sizes) + 1,), -7, dtype=dtype)
    views, at = [], 1
    for n in sizes:
        views.append(flat[at:at + n])
        at += n + 1
    for op in (hvd.Sum, hvd.Average):
        factors = dict(prescale_factor=2.0, postscale_factor=0.5) if dtype == torch.float32 else {}
        handles = [hvd.reducescatter_async(x, name=f"into.{dtype}.{op}.{i}", op=op, output=v, **factors)
                   for i, (x, v) in enumerate(zip(inputs, views))]
        got = [hvd.synchronize(h) for h in handles]
        assert all(g is v for g, v in zip(got, views)), "synchronize returns the output given"
        for i, (x, v) in enumerate(zip(inputs, views)):
            want = hvd.reducescatter(x, name=f"plain.{dtype}.{op}.{i}", op=op, **factors)
            assert want.dtype == v.dtype and want.numel() == v.numel(), (want.shape, v.shape)
            assert torch.equal(v, want.reshape(-1)), f"{dtype} op {op} tensor {i}: first wrong at {int((v != want.reshape(-1)).nonzero()[0])}"
        gaps = [0] + [int(sum(sizes[:k + 1])) + k + 1 for k in range(len(sizes))]
        assert all(int(flat[g]) == -7 for g in gaps), f"{dtype}: a sentinel between the outputs was overwritten"
        checks += 1

# NumPy: an output array of another shape but the block's element count.
x = ((np.arange(101 * 2) + rank) % 13).astype(np.float64).reshape(101, 2)
out = np.full(block(101) * 2, np.nan)
assert hnp.synchronize(hnp.reducescatter_async(x, name="np.into", op=hnp.Sum, output=out)) is out
assert np.array_equal(out, hnp.reducescatter(x, name="np.plain", op=hnp.Sum).reshape(-1)), "numpy output"
checks += 1

# Refusals, on every rank alike, before anything is sent.
x = torch.ones(10, 3)
for output, words in ((torch.empty(block(10) * 3 + 1), "this rank's block of a tensor of shape (10, 3)"),
                      (torch.empty(block(10) * 3, dtype=torch.float64), "float64, the input float32"),
                      (torch.empty(block(10) * 3 * 2)[::2], "contiguous"),
                      (x.view(-1)[3:3 + block(10) * 3], "shares memory with the input")):
    try:
        hvd.reducescatter_async(x, name="refused", output=output)
    except ValueError as error:
        assert words in str(error) and "refused" in str(error), str(error)
    else:
        raise AssertionError(f"an output that should be refused ({words}) was taken")
    checks += 1
assert torch.equal(hvd.reducescatter(x, name="refused", op=hvd.Sum), torch.full((block(10), 3), float(size))), \
    "the name of a refused op is free again"
checks += 1
print(f"rank {rank}: {checks} checks passed, 0 failed", flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size, settings", [(2, {}), (3, {}), (3, {"RVOD_SHM": "0"})], ids=["2-ranks", "3-ranks", "3-ranks-tcp"])
def test_reducescatter_writes_each_block_into_the_output_given(run_rvodrun, job_env, size, settings):
    job_env.update(settings)
    result = run_rvodrun(["-np", str(size), sys.executable, "-c", WORKER], timeout=120)
    assert_worker_job(result, {rank: 10 for rank in range(size)})
