"""rvod.numpy collectives on 4 ranks that two fake hosts share (RVOD_HOSTNAME differs; see
test_hierarchical.py): every op x dtype on the global set and on process sets that span the hosts.

Three phases, each after a fresh init: hierarchical allreduce and allgather forced on
(RVOD_HIERARCHICAL_*=1), forced off (HOROVOD_HIERARCHICAL_*=0), and left to the engine. Each phase checks
every result against exact expected values (small integers: every reduction order gives the same bits),
and the phases' results must be identical byte for byte. The topology (local/cross rank and size,
is_homogeneous) must be Horovod's for the layout, given for every rank, in rank order, as
RVOD_TEST_TOPOLOGY="lr,ls,cr,cs,homogeneous;lr,ls,cr,cs,homogeneous;...".
Each phase starts with a "PHASE name" line on stderr, so the test can see which algorithms its debug log
shows in each.
"""

import functools
import os
import sys

import numpy as np
import rvod.numpy as hvd
import _expected
from _check import check, finish
from rvod import _rvod

N = 4
contribution = functools.partial(_expected.contribution, n=N)
INTS = [np.uint8, np.int8, np.int16, np.int32, np.int64]
FLOATS = [np.float16, np.float32, np.float64]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
# 70,001 elements is above the 64 KiB from which the engine picks the hierarchical algorithms itself.
SHAPES = [(0,), (1,), (7,), (4097,), (70_001,)]
# Sets that span both hosts: one rank from each, and three ranks (uneven inside the set).
SPANNING = [[0, 2], [0, 1, 3]]




def expected_reduce(dtype, shape, op_name, seed, ranks):
    parts = [contribution(dtype, shape, r, seed, op_name == "Product").astype(np.float64) for r in ranks]
    stacked = np.stack(parts) if parts else np.zeros((0,) + shape)
    result = {"Sum": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}.get(op_name, np.sum)(stacked, axis=0)
    if op_name == "Average":
        result = result / len(ranks)
    return result.astype(dtype)


def same(got, want, label):
    assert got.dtype == want.dtype, (label, got.dtype, want.dtype)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    assert got.tobytes() == want.tobytes(), (label, got[:8], want[:8])


def run_phase(phase, results, ps_objects):
    R = hvd.rank()
    out = []

    def record(label, got, want):
        with check(f"{phase}: {label}"):
            same(got, want, label)
        out.append((label, np.asarray(got).tobytes()))

    for dtype in INTS + FLOATS + [np.bool_]:
        ops = ["Min", "Max"] if dtype is np.bool_ else list(OPS)
        for op_name in ops:
            for k, shape in enumerate(SHAPES):
                x = contribution(dtype, shape, R, k, op_name == "Product")
                got = hvd.allreduce(x, op=OPS[op_name], name=f"{phase}.ar.{np.dtype(dtype).name}.{op_name}.{k}")
                record(f"allreduce {np.dtype(dtype).name} {op_name} {shape}", got,
                       expected_reduce(dtype, shape, op_name, k, range(N)))
        if dtype is not np.bool_:
            group = [contribution(dtype, s, R, 30 + j) for j, s in enumerate(SHAPES[1:])]
            outs = hvd.grouped_allreduce(group, op=hvd.Sum, name=f"{phase}.gar.{np.dtype(dtype).name}")
            for j, (got, s) in enumerate(zip(outs, SHAPES[1:])):
                record(f"grouped allreduce {np.dtype(dtype).name} {s}", got,
                       expected_reduce(dtype, s, "Sum", 30 + j, range(N)))
        for rows, cols in [([1, 0, 3, 2], 5), ([20_000, 1, 0, 30_000], 3)]:
            part = contribution(dtype, (rows[R], cols), R, 40)
            got = hvd.allgather(part, name=f"{phase}.ag.{np.dtype(dtype).name}.{cols}")
            want = np.concatenate([contribution(dtype, (rows[r], cols), r, 40) for r in range(N)])
            record(f"allgather {np.dtype(dtype).name} rows {rows}", got, want)
        for root, count in [(0, 7), (3, 300_001)]:
            got = hvd.broadcast(contribution(dtype, (count,), R, 50), root, name=f"{phase}.bc.{np.dtype(dtype).name}.{root}")
            record(f"broadcast {np.dtype(dtype).name} root {root}", got, contribution(dtype, (count,), root, 50))
        splits = [(R + p) % 3 for p in range(N)]
        x = contribution(dtype, (sum(splits), 2), R, 60)
        got, received = hvd.alltoall(x, splits=splits, name=f"{phase}.a2a.{np.dtype(dtype).name}")
        pieces = []
        for p in range(N):
            theirs = [(p + q) % 3 for q in range(N)]
            start = sum(theirs[:R])
            pieces.append(contribution(dtype, (sum(theirs), 2), p, 60)[start:start + theirs[R]])
        record(f"alltoall {np.dtype(dtype).name}", got, np.concatenate(pieces))
        if dtype is not np.bool_:
            x = contribution(dtype, (4097, 3), R, 70)
            got = hvd.reducescatter(x, op=hvd.Sum, name=f"{phase}.rs.{np.dtype(dtype).name}")
            full = expected_reduce(dtype, (4097, 3), "Sum", 70, range(N))
            start = sum(4097 // N + (r < 4097 % N) for r in range(R))
            record(f"reducescatter {np.dtype(dtype).name}", got, full[start:start + 4097 // N + (R < 4097 % N)])

    for ranks, ps in zip(SPANNING, ps_objects):
        if R not in ranks:
            continue
        tag = "".join(map(str, ranks))
        for dtype in [np.int32, np.float32]:
            for k, shape in enumerate([(7,), (70_001,)]):
                got = hvd.allreduce(contribution(dtype, shape, R, 80 + k), op=hvd.Sum, process_set=ps,
                                    name=f"{phase}.ps{tag}.ar.{np.dtype(dtype).name}.{k}")
                record(f"set {ranks} allreduce {np.dtype(dtype).name} {shape}", got,
                       expected_reduce(dtype, shape, "Sum", 80 + k, ranks))
            got = hvd.allgather(contribution(dtype, (100 * R + 1, 2), R, 90), process_set=ps,
                                name=f"{phase}.ps{tag}.ag.{np.dtype(dtype).name}")
            want = np.concatenate([contribution(dtype, (100 * r + 1, 2), r, 90) for r in ranks])
            record(f"set {ranks} allgather {np.dtype(dtype).name}", got, want)
            root = ranks[-1]
            got = hvd.broadcast(contribution(dtype, (4097,), R, 95), root, process_set=ps,
                                name=f"{phase}.ps{tag}.bc.{np.dtype(dtype).name}")
            record(f"set {ranks} broadcast {np.dtype(dtype).name}", got, contribution(dtype, (4097,), root, 95))
    results[phase] = out


PHASES = [
    ("forced on", {"RVOD_HIERARCHICAL_ALLREDUCE": "1", "RVOD_HIERARCHICAL_ALLGATHER": "1"}),
    ("forced off", {"RVOD_HIERARCHICAL_ALLREDUCE": "", "RVOD_HIERARCHICAL_ALLGATHER": "",
                    "HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLGATHER": "0"}),
    ("engine's choice", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "", "HOROVOD_HIERARCHICAL_ALLGATHER": ""}),
]

results = {}
R = int(os.environ["RVOD_RANK"])
for phase, settings in PHASES:
    print(f"PHASE {phase}", file=sys.stderr, flush=True)
    os.environ.update(settings)
    sets = [hvd.ProcessSet(ranks) for ranks in SPANNING]
    hvd.init(process_sets=sets)
    with check(f"{phase}: topology"):
        want = os.environ["RVOD_TEST_TOPOLOGY"].split(";")[R].split(",")
        got = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()]
        assert [str(v) for v in got] == want, (got, want)
    with check(f"{phase}: shared memory inside the hosts, TCP (or UCX) across"):
        assert _rvod.transport_kind() == os.environ.get("RVOD_TEST_TRANSPORT_KIND", "shm+tcp"), _rvod.transport_kind()
    run_phase(phase, results, sets)
    hvd.shutdown()

with check("every phase gave the same bytes"):
    first = results[PHASES[0][0]]
    for phase, _ in PHASES[1:]:
        assert [label for label, _ in results[phase]] == [label for label, _ in first]
        differing = [label for (label, a), (_, b) in zip(first, results[phase]) if a != b]
        assert not differing, (phase, differing[:5])
finish(R)
