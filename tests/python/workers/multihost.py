"""Every op x dtype across hosts (network namespaces, see tests/python/netns.py), run by rvodrun with -H.

Argument: the ranks per host in placement order, e.g. ``2,2`` or ``1,3``. Checks the topology (rank,
local and cross ranks and sizes, is_homogeneous) against what that layout means, then every op with every
dtype rvod exchanges, against exact values: uint8, int8, uint16, int16, int32, int64, float16, float32,
float64 and bool through rvod.numpy, and bfloat16 through rvod.torch where PyTorch is installed (NumPy has
no bfloat16 that DLPack can carry). The ops: allreduce with every reduce op (Average only for floating
types, where it is exact; for bool Sum and Max are "or", Min and Product "and"), grouped allreduce,
allgather with a different first dimension per rank, broadcast from a root on each host, alltoall with
uneven splits, reducescatter, barrier, broadcast_object and allgather_object; and the same ops on process
sets that span hosts (the first and last rank, and one rank per host). Data depend only on the rank, so
every rank knows every result; values are small integers (sums up to 20, products up to 3**4), exact in
every dtype.
"""

import importlib.util
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


class NumpyArrays:
    """NumPy arrays of one dtype, exchanged by rvod.numpy."""

    hvd = hvd

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.name = self.dtype.name
        self.kind = self.dtype.kind

    def make(self, values):
        return np.asarray(values).astype(self.dtype)

    def read(self, tensor):
        """(dtype name, values as float64)."""
        return tensor.dtype.name, np.asarray(tensor).astype(np.float64)


class TorchBfloat16:
    """bfloat16 tensors, exchanged by rvod.torch (the same engine as rvod.numpy)."""

    name, kind = "bfloat16", "f"

    def __init__(self):
        import torch

        import rvod.torch

        self.torch, self.hvd = torch, rvod.torch

    def make(self, values):
        return self.torch.from_numpy(np.asarray(values, dtype=np.float32)).to(self.torch.bfloat16)

    def read(self, tensor):
        return str(tensor.dtype).removeprefix("torch."), tensor.to(self.torch.float64).numpy()


KINDS = [NumpyArrays(dtype) for dtype in (np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16,
                                          np.float32, np.float64, np.bool_)]
if importlib.util.find_spec("torch") is not None:
    KINDS.append(TorchBfloat16())
OPS = ["Sum", "Average", "Min", "Max", "Product"]


def values(rank, kind, count=11, product=False):
    """What `rank` contributes: 1..5 (1..3 for Product), or for bool a pattern of True and False."""
    i = np.arange(count)
    if kind.kind == "b":
        return (i + rank) % 3 == 0
    return (i + 2 * rank) % 3 + 1 if product else (i + 2 * rank) % 5 + 1


def reduced(op, kind, ranks, count=11):
    stack = np.stack([values(r, kind, count, op == "Product").astype(np.float64) for r in ranks])
    return {"Sum": stack.sum(0), "Average": stack.sum(0) / len(ranks), "Min": stack.min(0),
            "Max": stack.max(0), "Product": stack.prod(0)}[op]


def exact(out, expected, kind, label):
    """`out` has `kind`'s dtype and holds `expected` (exact values, cast to that dtype: nonzero is True)."""
    name, got = kind.read(out)
    assert name == kind.name, (label, name)
    want = kind.read(kind.make(expected))[1]
    assert np.array_equal(got, want), (label, got, want)


def run_ops(process_set, members, tag):
    """Every op on `process_set` (whose global ranks are `members`); ranks outside it skip."""
    if R not in members:
        return
    n, me = len(members), members.index(R)
    for kind in KINDS:
        lib, name = kind.hvd, kind.name
        for op_name in OPS:
            if op_name == "Average" and kind.kind != "f":
                continue  # an integer Average truncates; covered by the floating types
            with check(f"{tag} allreduce {op_name} {name}"):
                out = lib.allreduce(kind.make(values(R, kind, product=op_name == "Product")),
                                    op=getattr(lib, op_name), name=f"{tag}.ar.{op_name}.{name}",
                                    process_set=process_set)
                exact(out, reduced(op_name, kind, members), kind, f"allreduce {op_name} {name}")
        with check(f"{tag} grouped allreduce {name}"):
            outs = lib.grouped_allreduce([kind.make(values(R, kind, 3)), kind.make(values(R, kind, 1000))],
                                         op=lib.Sum, name=f"{tag}.gar.{name}", process_set=process_set)
            exact(outs[0], reduced("Sum", kind, members, 3), kind, "grouped 0")
            exact(outs[1], reduced("Sum", kind, members, 1000), kind, "grouped 1")
        with check(f"{tag} allgather {name}"):
            out = lib.allgather(kind.make(np.full((me + 1, 2), R)), name=f"{tag}.ag.{name}", process_set=process_set)
            exact(out, np.concatenate([np.full((i + 1, 2), r) for i, r in enumerate(members)]), kind, "allgather")
        for root in (members[0], members[-1]):
            with check(f"{tag} broadcast {name} from {root}"):
                out = lib.broadcast(kind.make(values(R, kind)), root_rank=root, name=f"{tag}.bc.{name}.{root}",
                                    process_set=process_set)
                exact(out, values(root, kind), kind, "broadcast")
        with check(f"{tag} alltoall {name}"):
            splits = [(me + i) % 3 for i in range(n)]  # rows this rank sends to member i
            rows = np.concatenate([np.full((count, 2), 10 * me + i) for i, count in enumerate(splits)])
            out, received = lib.alltoall(kind.make(rows), splits=splits, name=f"{tag}.a2a.{name}",
                                         process_set=process_set)
            expected = np.concatenate([np.full(((s + me) % 3, 2), 10 * s + me) for s in range(n)])
            exact(out, expected, kind, "alltoall")
            assert [int(v) for v in np.asarray(received).reshape(-1)] == [(s + me) % 3 for s in range(n)], received
        with check(f"{tag} reducescatter {name}"):
            rows = np.stack([values(R, kind, 3) for _ in range(2 * n)])
            out = lib.reducescatter(kind.make(rows), op=lib.Sum, name=f"{tag}.rs.{name}", process_set=process_set)
            exact(out, np.stack([reduced("Sum", kind, members, 3)] * 2), kind, "reducescatter")
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
