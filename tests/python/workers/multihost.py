"""rvod.numpy across hosts (network namespaces, see tests/python/netns.py), run by rvodrun with -H.

Argument: the ranks per host in placement order, e.g. ``2,2`` or ``1,3``. Checks the topology (rank,
local and cross ranks and sizes, is_homogeneous) against what that layout means, then every op with a few
dtypes against exact values: allreduce with every reduce op, grouped allreduce, allgather with a different
first dimension per rank, broadcast from a root on each host, alltoall with uneven splits, reducescatter,
barrier, broadcast_object and allgather_object; and the same ops on process sets that span hosts (the first
and last rank, and one rank per host). Data depend only on the rank, so every rank knows every result.
"""

import os
import sys

import numpy as np
from _check import check, finish

import rvod.numpy as hvd

LAYOUT = [int(count) for count in sys.argv[1].split(",")]
N_EXPECTED = sum(LAYOUT)
HOST_STARTS = [sum(LAYOUT[:index]) for index in range(len(LAYOUT))]
FIRST_AND_LAST = hvd.ProcessSet([0, N_EXPECTED - 1])
ONE_PER_HOST = hvd.ProcessSet(HOST_STARTS)
hvd.init(process_sets=[FIRST_AND_LAST, ONE_PER_HOST])
R, N = hvd.rank(), hvd.size()

with check("topology"):
    host = max(index for index, start in enumerate(HOST_STARTS) if start <= R)
    local_rank = R - HOST_STARTS[host]
    expected = {
        "size": N_EXPECTED,
        "local_rank": local_rank,
        "local_size": LAYOUT[host],
        "cross_rank": sum(1 for count in LAYOUT[:host] if count > local_rank),
        "cross_size": sum(1 for count in LAYOUT if count > local_rank),
        "is_homogeneous": len(set(LAYOUT)) == 1,
    }
    found = {"size": N, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
             "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "is_homogeneous": hvd.is_homogeneous()}
    assert found == expected, (found, expected)
    assert os.environ["RVOD_HOSTNAME"] == os.environ["RVOD_TEST_HOSTS"].split(",")[host], os.environ["RVOD_HOSTNAME"]

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


def contribution(rank, dtype, count=11):
    values = (np.arange(count) + 2 * rank) % 5 + 1  # 1..5: sums, products and averages stay exact
    return values.astype(dtype)


def reduced(op, dtype, ranks, count=11):
    stack = np.stack([contribution(r, dtype, count).astype(np.float64) for r in ranks])
    value = {"Sum": stack.sum(0), "Average": stack.sum(0) / len(ranks), "Min": stack.min(0),
             "Max": stack.max(0), "Product": stack.prod(0)}[op]
    return value


def exact(out, expected, dtype, label):
    assert out.dtype == np.dtype(dtype), (label, out.dtype)
    assert np.array_equal(out.astype(np.float64), np.asarray(expected, dtype=np.float64)), (label, out, expected)


def run_ops(process_set, members, tag):
    """Every op on `process_set` (whose global ranks are `members`); ranks outside it skip."""
    if R not in members:
        return
    n, me = len(members), members.index(R)
    for dtype in DTYPES:
        name = np.dtype(dtype).name
        for op_name, op in OPS.items():
            if op_name == "Average" and np.dtype(dtype).kind in "iu":
                continue  # integer Average truncates; covered by the float dtypes
            if op_name == "Product" and n > 3 and dtype in (np.uint8, np.float16):
                continue  # 5**4 overflows these
            with check(f"{tag} allreduce {op_name} {name}"):
                out = hvd.allreduce(contribution(R, dtype), op=op, name=f"{tag}.ar.{op_name}.{name}",
                                    process_set=process_set)
                exact(out, reduced(op_name, dtype, members), dtype, f"allreduce {op_name} {name}")
        with check(f"{tag} grouped allreduce {name}"):
            outs = hvd.grouped_allreduce([contribution(R, dtype, 3), contribution(R, dtype, 1000)], op=hvd.Sum,
                                         name=f"{tag}.gar.{name}", process_set=process_set)
            exact(outs[0], reduced("Sum", dtype, members, 3), dtype, "grouped 0")
            exact(outs[1], reduced("Sum", dtype, members, 1000), dtype, "grouped 1")
        with check(f"{tag} allgather {name}"):
            out = hvd.allgather(np.full((me + 1, 2), R, dtype=dtype), name=f"{tag}.ag.{name}",
                                process_set=process_set)
            exact(out, np.concatenate([np.full((i + 1, 2), r) for i, r in enumerate(members)]), dtype, "allgather")
        for root in (members[0], members[-1]):
            with check(f"{tag} broadcast {name} from {root}"):
                out = hvd.broadcast(contribution(R, dtype), root_rank=root, name=f"{tag}.bc.{name}.{root}",
                                    process_set=process_set)
                exact(out, contribution(root, dtype), dtype, "broadcast")
        with check(f"{tag} alltoall {name}"):
            splits = [(me + i) % 3 for i in range(n)]  # rows this rank sends to member i
            rows = np.concatenate([np.full((count, 2), 10 * me + i) for i, count in enumerate(splits)])
            out, received = hvd.alltoall(rows.astype(dtype), splits=splits, name=f"{tag}.a2a.{name}",
                                         process_set=process_set)
            expected = np.concatenate([np.full(((s + me) % 3, 2), 10 * s + me) for s in range(n)])
            exact(out, expected, dtype, "alltoall")
            assert [int(v) for v in np.asarray(received).reshape(-1)] == [(s + me) % 3 for s in range(n)], received
        with check(f"{tag} reducescatter {name}"):
            rows = np.stack([contribution(R, dtype, 3) for _ in range(2 * n)])
            out = hvd.reducescatter(rows, op=hvd.Sum, name=f"{tag}.rs.{name}", process_set=process_set)
            exact(out, np.stack([reduced("Sum", dtype, members, 3)] * 2), dtype, "reducescatter")
    with check(f"{tag} barrier and objects"):
        hvd.barrier(process_set=process_set)
        assert hvd.broadcast_object({"from": R}, root_rank=members[-1], name=f"{tag}.bo",
                                    process_set=process_set) == {"from": members[-1]}


run_ops(hvd.global_process_set, list(range(N)), "global")
run_ops(FIRST_AND_LAST, [0, N - 1], "first-last")
run_ops(ONE_PER_HOST, HOST_STARTS, "one-per-host")
with check("allgather_object"):
    assert hvd.allgather_object((R, os.environ["RVOD_HOSTNAME"])) == [
        (r, os.environ["RVOD_TEST_HOSTS"].split(",")[max(i for i, s in enumerate(HOST_STARTS) if s <= r)])
        for r in range(N)]
hvd.shutdown()
finish(R)
