"""Adasum on 4 ranks that two fake hosts share (started by test_adasum_hosts.py; RVOD_TEST_LAYOUT names
each rank's host, in rank order, e.g. "0,0,1,1"), against a NumPy reference computed on every rank from
every rank's inputs (they depend only on the rank).

Two phases, each after a fresh init: hierarchical allreduce left to the engine (Horovod's GPU variant: the
Adasum across hosts of each host's average, whatever the size) and forced off (HOROVOD_HIERARCHICAL_ALLREDUCE=0:
Adasum over all ranks in rvod's flat order; also what uneven hosts get in both phases). Cases: float32 and float64 of a few sizes (one past the ring
threshold), a grouped allreduce (fused, each tensor with its own coefficients) equal to per-tensor calls,
and postscale. Every rank must get the same bytes.
"""

import math
import os
import sys

import numpy as np
import rvod.numpy as hvd
from _check import check, finish

THRESHOLD = math.sqrt(np.finfo(np.float64).tiny)
HOSTS = [int(h) for h in os.environ["RVOD_TEST_LAYOUT"].split(",")]
N = len(HOSTS)
SHAPES = [(1,), (7,), (33, 3), (70_001,)]
# The engine is hierarchical only where every host has the same number of ranks, more than one.
SPLITS = len({HOSTS.count(h) for h in HOSTS}) == 1 and HOSTS.count(HOSTS[0]) > 1


def pair(a, b):
    dot, aa, bb = float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    ca = 1.0 - dot / (2 * aa) if aa >= THRESHOLD else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= THRESHOLD else 1.0
    return ca * a + cb * b


def flat_order(v):
    """docs/adasum.md's order: extra vectors folded into v[r - p], then the halving-doubling tree."""
    v = list(v)
    core = 1 << (len(v).bit_length() - 1)
    for extra in range(core, len(v)):
        v[extra - core] = pair(v[extra - core], v[extra])
    d = 1
    while d < core:
        for base in range(0, core, 2 * d):
            v[base] = pair(v[base], v[base + d])
        d *= 2
    return v[0]


def reference(per_rank, hierarchical):
    v = [np.asarray(x, dtype=np.float64).ravel() for x in per_rank]
    if not (hierarchical and SPLITS):
        return flat_order(v)
    hosts = sorted(set(HOSTS), key=HOSTS.index)  # numbered by their lowest rank, as the engine does
    averages = [np.mean([v[r] for r in range(N) if HOSTS[r] == h], axis=0) for h in hosts]
    return flat_order(averages)


def data(rank, shape, dtype, salt):
    return np.random.default_rng([rank, salt]).standard_normal(shape).astype(dtype)


def close(got, want, dtype, label):
    tolerance = 1e-11 if dtype == np.float64 else 2e-5
    err = np.max(np.abs(got.astype(np.float64).ravel() - want) / (1 + np.abs(want)), initial=0.0)
    assert err <= tolerance, f"{label}: relative error {err:.3g} > {tolerance}"


PHASES = [("engine's choice", {}, True), ("forced off", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, False)]
R = int(os.environ["RVOD_RANK"])
for phase, settings, hierarchical in PHASES:
    print(f"PHASE {phase}", file=sys.stderr, flush=True)
    os.environ.update(settings)
    hvd.init()
    assert hvd.size() == N and hvd.rank() == R
    for salt, shape in enumerate(SHAPES):
        for dtype in (np.float32, np.float64):
            label = f"{phase} {shape} {np.dtype(dtype).name}"
            got = hvd.allreduce(data(R, shape, dtype, salt), op=hvd.Adasum, name=f"ada.{salt}.{np.dtype(dtype).name}")
            everyone = hvd.allgather(got.reshape(1, -1))
            with check(label):
                assert got.dtype == dtype and got.shape == shape, (got.dtype, got.shape)
                assert all(row.tobytes() == everyone[0].tobytes() for row in everyone), "ranks differ"
                close(got, reference([data(r, shape, dtype, salt) for r in range(N)], hierarchical), dtype, label)
    # Fused: each tensor keeps its own coefficients, as in per-tensor calls.
    tensors = [data(R, shape, np.float32, 10 + i) for i, shape in enumerate(SHAPES[:3])]
    grouped = hvd.grouped_allreduce(tensors, op=hvd.Adasum, name="ada.grouped")
    single = [hvd.allreduce(t, op=hvd.Adasum, name=f"ada.single.{i}") for i, t in enumerate(tensors)]
    with check(f"{phase} grouped"):
        for i, (g, s) in enumerate(zip(grouped, single)):
            want = reference([data(r, SHAPES[i], np.float32, 10 + i) for r in range(N)], hierarchical)
            close(g, want, np.float32, f"grouped tensor {i}")
            np.testing.assert_allclose(g, s, rtol=1e-5, atol=1e-6)
    scaled = hvd.allreduce(data(R, (9,), np.float64, 20), op=hvd.Adasum, postscale_factor=0.5, name="ada.post")
    with check(f"{phase} postscale"):
        want = reference([data(r, (9,), np.float64, 20) for r in range(N)], hierarchical)
        close(scaled, 0.5 * want, np.float64, "postscale")
    hvd.shutdown()
finish(R)
