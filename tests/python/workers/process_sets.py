"""Process sets through rvod.numpy, one mode per job (first argument):

- ``static`` (rvodrun, 4 ranks, RVOD_STALL_CHECK_TIME_SECONDS=2): the ProcessSet API before and after
  init; duplicate sets refused before anything starts; init(process_sets=[...]) with permuted rank lists
  gives ids 1..k in order; every op (allreduce with every variant, allgather, broadcast, alltoall,
  reducescatter, barrier, broadcast_object) on the even set [0, 2], the odd set [1, 3] and the odd-sized
  set [0, 1, 2], against exact values; ranks outside a set refused at once; the same name in flight in
  two sets; mismatches inside the sets [0, 1, 2] and [1, 3], named by global rank; add_process_set refused
  without dynamic mode; and last, the two disjoint sets at the same time while rank 3 sleeps ~4.5 s: the even
  set finishes its work while rank 1 waits, and the odd set's coordinator (rank 1) warns about the stall naming
  set 2 and rank 3.
- ``dynamic`` (3 ranks): mismatched static sets at init; add refused without dynamic mode, allowed with
  RVOD_DYNAMIC_PROCESS_SETS=1, HOROVOD_DYNAMIC_PROCESS_SETS=1 and init(process_sets="dynamic") (for that
  init only, leaving os.environ alone), refused with -1 or 0, a value that is no flag refused by init; add (a
  list or a ProcessSet); every op on the added sets [0, 2], [1] and [1, 2]; duplicates; mismatched
  registration (every rank raises, the job goes on); remove (global set and unknown sets give False, ops
  on removed sets are refused); re-add, with freed ids handed out again in the order they were freed, as
  Horovod's ProcessSetTable does.
- ``naming`` (3 ranks): unnamed ops stay matched across ranks after a rank outside a set was refused an
  unnamed op, and after a subset ran unnamed ops on its own set.
- ``removal`` (3 ranks): an op pending on a set when the set is removed fails with RvodInternalError naming
  the removal (and the rank that removed it), and the job goes on.

Data depend only on the global rank, so every rank knows every result exactly. Values are small integers
(exact in every dtype used) and contributions are multiples of the set size, so Average is exact too.
"""

import os
import re
import sys
import time

import numpy as np
import rvod.numpy as hvd
from _check import check, expect_error, finish, wait_done
from rvod.exceptions import RvodInternalError, RvodMismatchError

MODE = sys.argv[1]
R = int(os.environ["RVOD_RANK"])




def assert_equal(out, expected, label=""):
    assert isinstance(out, np.ndarray), f"{label}: result is {type(out)}"
    assert out.dtype == expected.dtype, f"{label}: dtype {out.dtype} != {expected.dtype}"
    assert out.shape == expected.shape, f"{label}: shape {out.shape} != {expected.shape}"
    assert np.array_equal(out, expected), f"{label}: got\n{out}\nexpected\n{expected}"


# ------------------------------------------------------------------------------------ data and results

def contribution(rank, shape, dtype, m, seed=0):
    """What global `rank` sends: (rank + 1) * m * c with c in -5..5, so sums over any set are multiples
    of the set size m and the element-wise min and max come from different ranks."""
    count = int(np.prod(shape, dtype=np.int64))
    c = (np.arange(count, dtype=np.int64) * 5 + seed) % 11 - 5
    return ((rank + 1) * m * c).astype(dtype).reshape(shape)


def reduced(members, shape, dtype, op, seed=0, scale=1.0):
    m = len(members)
    stack = np.stack([contribution(r, shape, dtype, m, seed) for r in members]).astype(np.float64) * scale
    return {
        hvd.Sum: stack.sum(0),
        hvd.Average: stack.sum(0) / m,
        hvd.Min: stack.min(0),
        hvd.Max: stack.max(0),
    }[op].astype(dtype)


def gather_part(rank, cols=2, dtype=np.int32):
    """Global `rank` contributes rank + 1 rows (first dimensions differ across ranks)."""
    rows = rank + 1
    return (100 * rank + np.arange(rows * cols).reshape(rows, cols)).astype(dtype)


def alltoall_rows(rank, rows):
    return (1000 * rank + np.arange(rows * 3).reshape(rows, 3)).astype(np.float32)


def alltoall_splits(local, m):
    """How many rows the member with set rank `local` sends to each member (some zero, uneven)."""
    return [(local + 2 * j) % 3 for j in range(m)]


def shares(rows, m):
    """Rows of reducescatter each set rank gets: the first ones take the remainder."""
    sizes = [rows // m + (1 if i < rows % m else 0) for i in range(m)]
    starts = np.cumsum([0] + sizes)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(m)]


# --------------------------------------------------------------------------------------------- the op suite

def every_op(ps, tag):
    """Every op on `ps` (this rank is a member), checked against exact values. `tag` keeps names unique."""
    members = ps.ranks
    m = len(members)
    me = members.index(R)
    label = f"{tag} {members}"

    with check(f"{label}: rank(), size(), included()"):
        assert ps.rank() == me and ps.size() == m and ps.included() is True, (ps.rank(), ps.size())

    for dtype in (np.float64, np.float32, np.int32):
        for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average), ("Min", hvd.Min), ("Max", hvd.Max)):
            if op == hvd.Average and dtype is np.int32:
                continue
            for shape in ((7,), (2, 3), (4097,)):
                with check(f"{label}: allreduce {op_name} {np.dtype(dtype).name} {shape}"):
                    x = contribution(R, shape, dtype, m)
                    out = hvd.allreduce(x, op=op, name=f"{tag}.ar.{op_name}.{np.dtype(dtype).name}.{len(shape)}"
                                        f".{shape[0]}", process_set=ps)
                    assert_equal(out, reduced(members, shape, dtype, op), "allreduce")
                    assert np.array_equal(x, contribution(R, shape, dtype, m)), "the input changed"

    with check(f"{label}: Average divides by the set size ({m}), not the job size"):
        out = hvd.allreduce(np.full(3, float(m * (R + 1))), name=f"{tag}.avg.default", process_set=ps)
        assert_equal(out, np.full(3, float(sum(r + 1 for r in members))), "default op (Average)")
        out = hvd.allreduce(np.full(3, float(m * (R + 1))), average=True, name=f"{tag}.avg.flag", process_set=ps)
        assert_equal(out, np.full(3, float(sum(r + 1 for r in members))), "average=True")

    with check(f"{label}: allreduce with prescale and postscale"):
        x = contribution(R, (5,), np.float64, m, seed=3)
        out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 / m,
                            name=f"{tag}.ar.scaled", process_set=ps)
        assert_equal(out, reduced(members, (5,), np.float64, hvd.Sum, seed=3, scale=1.0 / m), "scaled")

    with check(f"{label}: allreduce_ in place"):
        x = contribution(R, (6,), np.float32, m, seed=1)
        out = hvd.allreduce_(x, op=hvd.Sum, name=f"{tag}.ar_", process_set=ps)
        assert out is x, "allreduce_ did not return its argument"
        assert_equal(x, reduced(members, (6,), np.float32, hvd.Sum, seed=1), "in place")

    with check(f"{label}: allreduce_async + poll + synchronize"):
        x = contribution(R, (9,), np.float64, m, seed=2)
        handle = hvd.allreduce_async(x, op=hvd.Average, name=f"{tag}.ar.async", process_set=ps)
        wait_done(hvd.poll, handle)
        assert_equal(hvd.synchronize(handle), reduced(members, (9,), np.float64, hvd.Average, seed=2), "async")

    with check(f"{label}: allreduce_async_ in place"):
        x = contribution(R, (4,), np.int32, m, seed=4)
        handle = hvd.allreduce_async_(x, op=hvd.Max, name=f"{tag}.ar.async_", process_set=ps)
        assert hvd.synchronize(handle) is x
        assert_equal(x, reduced(members, (4,), np.int32, hvd.Max, seed=4), "async in place")

    with check(f"{label}: grouped_allreduce"):
        xs = [contribution(R, (3,), np.float32, m, seed=5), contribution(R, (2, 2), np.float32, m, seed=6)]
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name=f"{tag}.gar", process_set=ps)
        assert len(outs) == 2
        assert_equal(outs[0], reduced(members, (3,), np.float32, hvd.Sum, seed=5), "group 0")
        assert_equal(outs[1], reduced(members, (2, 2), np.float32, hvd.Sum, seed=6), "group 1")

    with check(f"{label}: grouped_allreduce_ in place"):
        xs = [contribution(R, (5,), np.float64, m, seed=7), contribution(R, (1,), np.float64, m, seed=8)]
        outs = hvd.grouped_allreduce_(xs, op=hvd.Average, name=f"{tag}.gar_", process_set=ps)
        assert outs[0] is xs[0] and outs[1] is xs[1]
        assert_equal(xs[0], reduced(members, (5,), np.float64, hvd.Average, seed=7), "group 0")
        assert_equal(xs[1], reduced(members, (1,), np.float64, hvd.Average, seed=8), "group 1")

    expected_gather = np.concatenate([gather_part(r) for r in members])
    with check(f"{label}: allgather (first dimensions differ)"):
        assert_equal(hvd.allgather(gather_part(R), name=f"{tag}.ag", process_set=ps), expected_gather, "allgather")
    with check(f"{label}: allgather_async"):
        handle = hvd.allgather_async(gather_part(R, dtype=np.float64), name=f"{tag}.ag.async", process_set=ps)
        assert_equal(hvd.synchronize(handle), expected_gather.astype(np.float64), "allgather async")
    with check(f"{label}: grouped_allgather"):
        outs = hvd.grouped_allgather([gather_part(R), gather_part(R, cols=1, dtype=np.int64)],
                                     name=f"{tag}.gag", process_set=ps)
        assert_equal(outs[0], expected_gather, "group 0")
        assert_equal(outs[1], np.concatenate([gather_part(r, 1, np.int64) for r in members]), "group 1")

    def value(rank):
        return np.full((2, 2), 100 * rank + 7, dtype=np.int64)

    for root in members:
        with check(f"{label}: broadcast from global rank {root}"):
            assert_equal(hvd.broadcast(value(R), root, name=f"{tag}.bc.{root}", process_set=ps), value(root),
                         "broadcast")
        with check(f"{label}: broadcast_ in place from global rank {root}"):
            x = value(R)
            assert hvd.broadcast_(x, root, name=f"{tag}.bc_.{root}", process_set=ps) is x
            assert_equal(x, value(root), "broadcast_")
        with check(f"{label}: broadcast_async from global rank {root}"):
            handle = hvd.broadcast_async(value(R).astype(np.float32), root, name=f"{tag}.bc.async.{root}",
                                         process_set=ps)
            assert_equal(hvd.synchronize(handle), value(root).astype(np.float32), "broadcast_async")
    outsider = next(r for r in range(hvd.size()) if r not in members) if m < hvd.size() else None
    if outsider is not None:
        with check(f"{label}: broadcast from global rank {outsider} (not in the set) is refused"):
            expect_error(ValueError, rf"root_rank {outsider}\b", hvd.broadcast, np.ones(2), outsider,
                         name=f"{tag}.bc.outsider", process_set=ps)
            x = np.ones(2)
            expect_error(ValueError, r"root", hvd.broadcast_, x, outsider, name=f"{tag}.bc_.outsider",
                         process_set=ps)
            assert np.array_equal(x, np.ones(2)), "a refused broadcast_ wrote into its argument"

    with check(f"{label}: alltoall, even split"):
        out = hvd.alltoall(alltoall_rows(R, 2 * m), name=f"{tag}.a2a", process_set=ps)
        expected = np.concatenate([alltoall_rows(r, 2 * m)[2 * me:2 * me + 2] for r in members])
        assert_equal(out, expected, "alltoall")
    with check(f"{label}: alltoall with splits"):
        splits = alltoall_splits(me, m)
        out, received = hvd.alltoall(alltoall_rows(R, sum(splits)), splits=splits, name=f"{tag}.a2a.splits",
                                     process_set=ps)
        parts, expected_received = [], []
        for src_local, src in enumerate(members):
            src_splits = alltoall_splits(src_local, m)
            start = sum(src_splits[:me])
            parts.append(alltoall_rows(src, sum(src_splits))[start:start + src_splits[me]])
            expected_received.append(src_splits[me])
        assert_equal(out, np.concatenate(parts), "alltoall with splits")
        assert [int(s) for s in received] == expected_received, (list(received), expected_received)
    with check(f"{label}: alltoall_async"):
        handle = hvd.alltoall_async(alltoall_rows(R, m), name=f"{tag}.a2a.async", process_set=ps)
        expected = np.concatenate([alltoall_rows(r, m)[me:me + 1] for r in members])
        assert_equal(hvd.synchronize(handle), expected, "alltoall_async")

    rows = 2 * m + 1
    lo, hi = shares(rows, m)[me]
    for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
        with check(f"{label}: reducescatter {op_name} of {rows} rows"):
            out = hvd.reducescatter(contribution(R, (rows, 2), np.float64, m, seed=9), op=op,
                                    name=f"{tag}.rs.{op_name}", process_set=ps)
            assert_equal(out, reduced(members, (rows, 2), np.float64, op, seed=9)[lo:hi], "reducescatter")
    with check(f"{label}: reducescatter_async (default op Average)"):
        handle = hvd.reducescatter_async(contribution(R, (rows,), np.float32, m, seed=10), name=f"{tag}.rs.async",
                                         process_set=ps)
        assert_equal(hvd.synchronize(handle), reduced(members, (rows,), np.float32, hvd.Average, seed=10)[lo:hi],
                     "reducescatter_async")
    with check(f"{label}: grouped_reducescatter"):
        xs = [contribution(R, (rows, 2), np.int32, m, seed=11), contribution(R, (m,), np.int32, m, seed=12)]
        outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, name=f"{tag}.grs", process_set=ps)
        assert_equal(outs[0], reduced(members, (rows, 2), np.int32, hvd.Sum, seed=11)[lo:hi], "group 0")
        assert_equal(outs[1], reduced(members, (m,), np.int32, hvd.Sum, seed=12)[me:me + 1], "group 1")

    with check(f"{label}: broadcast_object from the last member"):
        got = hvd.broadcast_object({"from": R}, root_rank=members[-1], name=f"{tag}.obj", process_set=ps)
        assert got == {"from": members[-1]}, got

    with check(f"{label}: barrier waits for the set's last member"):
        hvd.barrier(process_set=ps)
        start = time.monotonic()
        if R == members[-1]:
            time.sleep(0.5)
        hvd.barrier(process_set=ps)
        waited = time.monotonic() - start
        assert waited >= 0.3 or m == 1, f"left the barrier after {waited:.2f} s, before the last member came"


def refused_outside(ps, tag):
    """This rank is not in `ps`: every op on it fails at once with ValueError, nothing is sent."""
    members = ps.ranks
    label = f"{tag} {members}"
    with check(f"{label}: API from a non-member"):
        assert ps.included() is False
        assert ps.size() == len(members)
        expect_error(ValueError, "Process is not part of provided process set", ps.rank)
    x = np.ones(2 * len(members), dtype=np.float32)
    calls = [
        ("allreduce", lambda: hvd.allreduce(x, name=f"{tag}.out.ar", process_set=ps)),
        ("allreduce_", lambda: hvd.allreduce_(x.copy(), name=f"{tag}.out.ar_", process_set=ps)),
        ("allreduce_async", lambda: hvd.allreduce_async(x, name=f"{tag}.out.ar.async", process_set=ps)),
        ("allreduce_async_", lambda: hvd.allreduce_async_(x.copy(), name=f"{tag}.out.ar.async_", process_set=ps)),
        ("grouped_allreduce", lambda: hvd.grouped_allreduce([x, x], name=f"{tag}.out.gar", process_set=ps)),
        ("allgather", lambda: hvd.allgather(x, name=f"{tag}.out.ag", process_set=ps)),
        ("grouped_allgather", lambda: hvd.grouped_allgather([x], name=f"{tag}.out.gag", process_set=ps)),
        ("broadcast", lambda: hvd.broadcast(x, members[0], name=f"{tag}.out.bc", process_set=ps)),
        ("broadcast_", lambda: hvd.broadcast_(x.copy(), members[0], name=f"{tag}.out.bc_", process_set=ps)),
        ("alltoall", lambda: hvd.alltoall(x, name=f"{tag}.out.a2a", process_set=ps)),
        ("reducescatter", lambda: hvd.reducescatter(x, name=f"{tag}.out.rs", process_set=ps)),
        ("grouped_reducescatter", lambda: hvd.grouped_reducescatter([x], name=f"{tag}.out.grs", process_set=ps)),
        ("barrier", lambda: hvd.barrier(process_set=ps)),
    ]
    for op_label, call in calls:
        with check(f"{label}: {op_label} from non-member rank {R} raises ValueError at once"):
            start = time.monotonic()
            message = expect_error(ValueError, rf"Rank {R} is not a member of the provided process set", call)
            assert time.monotonic() - start < 0.5, f"took {time.monotonic() - start:.2f} s"
            assert str(members) in message, message


def global_sum_works(label):
    with check(f"global allreduce after {label}"):
        out = hvd.allreduce(np.full(3, R + 1, dtype=np.int64), op=hvd.Sum, name=f"global.after.{label}")
        n = hvd.size()
        assert_equal(out, np.full(3, n * (n + 1) // 2, dtype=np.int64), "global allreduce")


# ------------------------------------------------------------------------------------------------- modes

def api_before_init():
    with check("ProcessSet before registration"):
        ps = hvd.ProcessSet([3, 1])
        assert ps.ranks == [1, 3] and ps.process_set_id is None and ps.size() is None
        assert ps == hvd.ProcessSet((1, 3)) and hash(ps) == hash(hvd.ProcessSet([1, 3]))
        assert ps != hvd.ProcessSet([1, 2]) and ps != hvd.ProcessSet([1, 3, 0])
        assert str(ps) == "ProcessSet(process_set_id=None, ranks=[1, 3], mpi_comm=None)", str(ps)
        assert hvd.global_process_set.process_set_id == 0
    with check("ProcessSet with a repeated rank is refused"):
        expect_error(ValueError, "", hvd.ProcessSet, [1, 1])


def static():
    api_before_init()
    with check("init with duplicate sets (one a permutation of the other) raises ValueError, starts nothing"):
        start = time.monotonic()
        duplicates = [hvd.ProcessSet([0, 2]), hvd.ProcessSet([2, 0])]
        expect_error(ValueError, r"duplicate", hvd.init, process_sets=duplicates)
        assert time.monotonic() - start < 1.0, f"took {time.monotonic() - start:.2f} s"
        assert hvd.is_initialized() is False

    even, odd, trio = hvd.ProcessSet([2, 0]), hvd.ProcessSet([3, 1]), hvd.ProcessSet([2, 0, 1])
    hvd.init(process_sets=[even, odd, trio])
    assert hvd.size() == 4, "the static mode runs with 4 ranks"
    with check("static sets get ids 1..k in list order, ranks sorted"):
        assert [ps.process_set_id for ps in (even, odd, trio)] == [1, 2, 3]
        assert (even.ranks, odd.ranks, trio.ranks) == ([0, 2], [1, 3], [0, 1, 2])
        assert hvd.global_process_set.ranks == [0, 1, 2, 3] and hvd.global_process_set.size() == 4
        assert hvd.global_process_set.rank() == R and hvd.global_process_set.included()
    with check("registered sets: equality by ranks, str"):
        assert even == hvd.ProcessSet([0, 2]) and even != odd and trio == hvd.ProcessSet([1, 2, 0])
        assert str(even) == "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)", str(even)
        assert str(trio) == "ProcessSet(process_set_id=3, ranks=[0, 1, 2], mpi_comm=None)", str(trio)
        assert str(hvd.global_process_set) == "ProcessSet(process_set_id=0, ranks=[0, 1, 2, 3], mpi_comm=None)"

    for tag, ps in (("even", even), ("odd", odd), ("trio", trio)):
        if ps.included():
            every_op(ps, tag)
        else:
            refused_outside(ps, tag)
    global_sum_works("the op suites")

    with check("the same name in flight in two sets at once"):
        mine = even if R % 2 == 0 else odd
        handles = [(mine, hvd.allreduce_async(np.full(2, R + 1.0), op=hvd.Sum, name="shared", process_set=mine))]
        if trio.included():
            handles.append((trio, hvd.allreduce_async(np.full(2, 10.0 * (R + 1)), op=hvd.Sum, name="shared",
                                                      process_set=trio)))
        for ps, handle in handles:
            scale = 10.0 if ps is trio else 1.0
            assert_equal(hvd.synchronize(handle), np.full(2, scale * sum(r + 1 for r in ps.ranks)), str(ps))

    if trio.included():
        with check("a mismatch inside a set: RvodMismatchError naming global ranks; the set goes on"):
            message = expect_error(RvodMismatchError, "shape", hvd.allreduce, np.ones(3 if R == 2 else 2),
                                   name="trio.mismatch", process_set=trio)
            assert re.search(r"\brank 2 sent \[3\]", message) and re.search(r"\branks 0, 1 sent \[2\]", message), \
                message
            out = hvd.allreduce(np.ones(2), op=hvd.Sum, name="trio.after.mismatch", process_set=trio)
            assert_equal(out, np.full(2, 3.0), "after the mismatch")
    if odd.included():
        # In [1, 3] a rank's position in the set is not its rank: the message must say 1 and 3, never 0.
        with check("a mismatch inside the odd set names global ranks 1 and 3, not positions 0 and 1"):
            message = expect_error(RvodMismatchError, "dtype|data type", hvd.allreduce,
                                   np.ones(2, dtype=np.float32 if R == 1 else np.float64), name="odd.mismatch",
                                   process_set=odd)
            assert re.search(r"\brank 1 sent float32; rank 3 sent float64\b", message), message
            assert not re.search(r"\brank 0\b", message), message

    with check("add_process_set without dynamic mode raises ValueError naming RVOD_DYNAMIC_PROCESS_SETS"):
        assert not os.environ.get("RVOD_DYNAMIC_PROCESS_SETS") and not os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS")
        expect_error(ValueError, "RVOD_DYNAMIC_PROCESS_SETS", hvd.add_process_set, [0, 3])
        expect_error(ValueError, "RVOD_DYNAMIC_PROCESS_SETS", hvd.add_process_set, hvd.ProcessSet([1, 2]))
    global_sum_works("the refused add")

    # Two disjoint sets at once. Rank 3 sleeps; the even set works meanwhile and finishes long before
    # rank 1's allreduce in the odd set can complete. The odd set's coordinator (rank 1) warns about the
    # stall after RVOD_STALL_CHECK_TIME_SECONDS=2, naming set 2 and rank 3.
    sleep = 4.5  # a stall check (every 2 s) is sure to fall between 2 s and 4 s of waiting
    hvd.barrier()
    start = time.monotonic()
    with check("concurrent sets: each set's work completes with the right values"):
        if R == 3:
            time.sleep(sleep)
        if R % 2 == 0:
            for step in range(20):
                out = hvd.allreduce(np.full(1000, R + step, dtype=np.float32), op=hvd.Sum,
                                    name=f"fast.{step}", process_set=even)
                assert_equal(out, np.full(1000, 2 + 2 * step, dtype=np.float32), f"step {step}")
            assert_equal(hvd.allgather(np.array([R]), name="fast.gather", process_set=even), np.array([0, 2]),
                         "fast allgather")
        else:
            out = hvd.allreduce(np.full(4, float(R)), op=hvd.Sum, name="ps.stall", process_set=odd)
            assert_equal(out, np.full(4, 4.0), "slow allreduce")
    elapsed = time.monotonic() - start
    print(f"rank {R}: concurrent phase took {elapsed:.2f} s", flush=True)
    # The even ranks idle until rank 3 is awake, so that their next global op does not stall as well and
    # the odd set's warning is the only one.
    time.sleep(max(0.0, sleep + 0.5 - (time.monotonic() - start)))
    timings = hvd.allgather(np.array([elapsed]), name="timings")
    with check("concurrent sets: the even set finished while rank 1 still waited for the sleeping rank 3"):
        even_done, waiting = max(timings[0], timings[2]), timings[1]
        assert waiting >= sleep - 0.5, f"rank 1's allreduce returned after {waiting:.2f} s, before rank 3 woke up"
        assert even_done < 2.0, f"the even set took {even_done:.2f} s: it waited for the odd set ({timings})"
        assert even_done < waiting - 1.5, f"timings {timings}"
    global_sum_works("the concurrent phase")
    hvd.shutdown()
    finish(R)


def dynamic():
    assert not os.environ.get("RVOD_DYNAMIC_PROCESS_SETS") and not os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS")
    api_before_init()
    with check("init where ranks register different static sets: ValueError on every rank naming each"):
        mine = [hvd.ProcessSet([0, 1])] if R == 0 else [hvd.ProcessSet([1, 2])]
        message = expect_error(ValueError, "registered different process sets", hvd.init, process_sets=mine)
        for rank, ranks in ((0, "[0, 1]"), (1, "[1, 2]"), (2, "[1, 2]")):
            assert f"rank {rank} registered {ranks}" in message, message
        assert hvd.is_initialized() is False
        assert mine[0].process_set_id is None

    hvd.init()
    assert hvd.size() == 3, "the dynamic mode runs with 3 ranks"
    with check("add_process_set without dynamic mode raises ValueError naming RVOD_DYNAMIC_PROCESS_SETS"):
        expect_error(ValueError, "RVOD_DYNAMIC_PROCESS_SETS", hvd.add_process_set, [0, 1])
    hvd.shutdown()

    for variable in ("RVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_DYNAMIC_PROCESS_SETS"):
        os.environ[variable] = "1"  # set before init, as Horovod scripts do
        hvd.init()
        with check(f"{variable}=1 allows adding and removing"):
            ps = hvd.add_process_set([1, 0])
            assert ps.process_set_id == 1 and ps.ranks == [0, 1]
            if ps.included():
                out = hvd.allreduce(np.full(2, R + 1), op=hvd.Sum, name="alias.sum", process_set=ps)
                assert_equal(out, np.full(2, 3), "allreduce")
            assert hvd.remove_process_set(ps) is True and ps.process_set_id is None
        hvd.shutdown()
        del os.environ[variable]

    for variable, value in (("HOROVOD_DYNAMIC_PROCESS_SETS", "-1"), ("RVOD_DYNAMIC_PROCESS_SETS", "0")):
        os.environ[variable] = value
        hvd.init()
        with check(f"{variable}={value} leaves dynamic process sets off (Horovod's rule: on when > 0)"):
            expect_error(ValueError, "RVOD_DYNAMIC_PROCESS_SETS", hvd.add_process_set, [0, 1])
        hvd.shutdown()
        del os.environ[variable]
    os.environ["RVOD_DYNAMIC_PROCESS_SETS"] = "maybe"
    with check("RVOD_DYNAMIC_PROCESS_SETS=maybe: init refuses it, naming the variable and the value"):
        expect_error(ValueError, r'invalid environment variable RVOD_DYNAMIC_PROCESS_SETS="maybe": expected 0/1 or '
                     "true/false", hvd.init)
        assert not hvd.is_initialized()
    del os.environ["RVOD_DYNAMIC_PROCESS_SETS"]

    with check('init(process_sets="dynamic") turns them on for that init only, without touching os.environ'):
        hvd.init(process_sets="dynamic")
        assert "RVOD_DYNAMIC_PROCESS_SETS" not in os.environ and "HOROVOD_DYNAMIC_PROCESS_SETS" not in os.environ
        assert hvd.remove_process_set(hvd.ProcessSet([0])) is False  # allowed (and nothing to remove)
        hvd.shutdown()
        hvd.init()
        expect_error(ValueError, "RVOD_DYNAMIC_PROCESS_SETS", hvd.add_process_set, [0, 1])
        hvd.shutdown()

    hvd.init(process_sets="dynamic")
    with check("add_process_set (list and ProcessSet) assigns ids 1, 2, 3 in call order"):
        even = hvd.add_process_set([2, 0])
        given = hvd.ProcessSet([2, 1])
        pair = hvd.add_process_set(given)
        odd = hvd.add_process_set([1])
        assert pair is given, "add_process_set(ProcessSet) should return the object it was given"
        assert [even.process_set_id, pair.process_set_id, odd.process_set_id] == [1, 2, 3]
        assert (even.ranks, pair.ranks, odd.ranks) == ([0, 2], [1, 2], [1])
        assert str(even) == "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)", str(even)

    for tag, ps in (("even", even), ("odd", odd), ("pair", pair)):
        if ps.included():
            every_op(ps, tag)
        else:
            refused_outside(ps, tag)
    global_sum_works("the dynamic op suites")

    with check("adding a duplicate set raises ValueError"):
        expect_error(ValueError, "duplicate", hvd.add_process_set, [0, 2])
        expect_error(ValueError, "duplicate", hvd.add_process_set, hvd.ProcessSet([2, 0]))
        expect_error(ValueError, "duplicate", hvd.add_process_set, [0, 1, 2])  # the global set's ranks
        expect_error(ValueError, "registered", hvd.add_process_set, pair)  # already registered

    with check("mismatched registration: ValueError on every rank naming what each rank registered"):
        start = time.monotonic()
        message = expect_error(ValueError, "registered different process sets", hvd.add_process_set,
                               [0] if R == 2 else [0, 1])
        assert time.monotonic() - start < 5.0, f"took {time.monotonic() - start:.2f} s"
        for rank, ranks in ((0, "[0, 1]"), (1, "[0, 1]"), (2, "[0]")):
            assert f"rank {rank} registered {ranks}" in message, message
    with check("after the mismatched registration the job goes on: the next add works everywhere"):
        lower = hvd.add_process_set([0, 1])
        assert lower.process_set_id == 4, lower
        if lower.included():
            out = hvd.allreduce(np.full(2, float(R + 1)), op=hvd.Sum, name="lower.sum", process_set=lower)
            assert_equal(out, np.full(2, 3.0), "allreduce on the set added after the mismatch")
    global_sum_works("the mismatched registration")

    with check("remove_process_set: the global set and unregistered sets give False"):
        assert hvd.remove_process_set(hvd.global_process_set) is False
        assert hvd.global_process_set.process_set_id == 0
        assert hvd.remove_process_set(hvd.ProcessSet([0])) is False
        assert hvd.remove_process_set(hvd.ProcessSet([0, 2])) is False  # same ranks as `even`, not registered
        assert even.process_set_id == 1
    with check("remove_process_set removes registered sets and invalidates the object"):
        assert hvd.remove_process_set(pair) is True and pair.process_set_id is None
        assert hvd.remove_process_set(even) is True and even.process_set_id is None
        assert hvd.remove_process_set(pair) is False
    with check("an op on a removed set raises ValueError at once"):
        for ps in (pair, even):
            start = time.monotonic()
            expect_error(ValueError, "does not exist, or has not been registered", hvd.allreduce, np.ones(2),
                         name=f"removed.{ps.ranks}", process_set=ps)
            expect_error(ValueError, "does not exist, or has not been registered", hvd.barrier, process_set=ps)
            assert time.monotonic() - start < 0.5
    global_sum_works("the removals")

    with check("re-add: freed ids go to the next sets in the order they were freed (2, then 1), then 5"):
        again = hvd.add_process_set([0, 2])  # the same ranks as the removed `even`
        other = hvd.add_process_set([2, 1])
        fresh = hvd.add_process_set([0])
        ids = [again.process_set_id, other.process_set_id, fresh.process_set_id]
        assert ids == [2, 1, 5], f"ids {ids}; Horovod's ProcessSetTable reuses freed ids first in, first out"
    with check("the removed objects stay invalid after their ranks are registered again"):
        assert even.process_set_id is None
        expect_error(ValueError, "does not exist, or has not been registered", hvd.allreduce, np.ones(2),
                     name="stale", process_set=even)
    for ps in (again, other, fresh):
        if not ps.included():
            continue
        with check(f"re-added set {ps.ranks}: allreduce, allgather, broadcast"):
            m = len(ps.ranks)
            tag = f"readd.{'.'.join(map(str, ps.ranks))}"
            out = hvd.allreduce(contribution(R, (5,), np.float64, m), name=f"{tag}.avg", process_set=ps)
            assert_equal(out, reduced(ps.ranks, (5,), np.float64, hvd.Average), "allreduce")
            out = hvd.allgather(gather_part(R), name=f"{tag}.ag", process_set=ps)
            assert_equal(out, np.concatenate([gather_part(r) for r in ps.ranks]), "allgather")
            out = hvd.broadcast(np.full(3, R), ps.ranks[-1], name=f"{tag}.bc", process_set=ps)
            assert_equal(out, np.full(3, ps.ranks[-1]), "broadcast")
            hvd.barrier(process_set=ps)
    global_sum_works("the re-adds")
    hvd.shutdown()
    with check("shutdown unregisters every set"):
        assert again.process_set_id is None and fresh.process_set_id is None
        assert hvd.global_process_set.process_set_id == 0
    finish(R)


def settle(handle, expected, label, timeout=4.0):
    """Waits up to `timeout` for `handle`; on time-out the check fails but the job goes on."""
    deadline = time.monotonic() + timeout
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            raise AssertionError(f"{label}: no result after {timeout} s (names no longer match across ranks?)")
        time.sleep(0.01)
    assert_equal(hvd.synchronize(handle), expected, label)


def naming():
    """Unnamed ops are matched by their generated names: a rank outside a set that is refused an unnamed op,
    or a subset running unnamed ops on its own set, must not shift the names of later unnamed ops."""
    even = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[even])
    n = hvd.size()
    assert n == 3, "the naming mode runs with 3 ranks"
    with check("unnamed global allreduce after a non-member was refused an unnamed op on a set"):
        if R == 1:
            expect_error(ValueError, "not a member", hvd.allreduce, np.ones(2), process_set=even)
        handle = hvd.allreduce_async(np.full(2, float(R)), op=hvd.Sum)
        settle(handle, np.full(2, float(n * (n - 1) // 2)), "unnamed global allreduce")
    global_sum_works("the refused unnamed op")
    hvd.shutdown()  # restarts the name counter, so the second case does not inherit the first one's outcome
    hvd.init(process_sets=[even])
    with check("unnamed global allreduce after the set's members ran unnamed ops on their set"):
        if even.included():
            out = hvd.allreduce(np.full(2, float(R)), op=hvd.Sum, process_set=even)
            assert_equal(out, np.full(2, 2.0), "unnamed allreduce on the even set")
            assert_equal(hvd.allgather(np.array([R]), process_set=even), np.array([0, 2]), "unnamed allgather")
        handle = hvd.allreduce_async(np.full(2, float(R + 1)), op=hvd.Sum)
        settle(handle, np.full(2, float(n * (n + 1) // 2)), "unnamed global allreduce")
    global_sum_works("the subset's unnamed ops")
    hvd.shutdown()
    finish(R)


def removal():
    """An op pending on a set when the set is removed fails with RvodInternalError naming the removal, not a
    shutdown: whether the rank waiting for it removes the set too, or waits while rank 0 removes it. Rank 0
    never submits the op, so only the removal can end it. The job goes on."""
    hvd.init(process_sets="dynamic")
    assert hvd.size() == 3, "the removal mode runs with 3 ranks"
    # The message starts with what happened (not "rvod has been shut down", which the job was not).
    removed = r"^process set 1 \(ranks \[0, 2\]\).* \(remove_process_set\(\)\)"

    pair = hvd.add_process_set([0, 2])
    handle = hvd.allreduce_async(np.ones(4), op=hvd.Sum, name="orphan.own", process_set=pair) if R == 2 else None
    hvd.barrier()  # rank 2's op is queued before any rank removes the set
    with check("every rank removes the set: the op pending on it fails naming the removal"):
        assert hvd.remove_process_set(pair) is True
        if R == 2:
            start = time.monotonic()
            # Rank 0's removal may reach rank 2's engine before rank 2's own: then the error names rank 0 too.
            message = expect_error(RvodInternalError, "^(rank 0 removed )?" + removed[1:], hvd.synchronize, handle)
            assert "called shutdown()" not in message, message
            assert time.monotonic() - start < 2.0, f"took {time.monotonic() - start:.2f} s"
    global_sum_works("an op failed by its set's removal")

    pair = hvd.add_process_set([0, 2])
    handle = hvd.allreduce_async(np.ones(4), op=hvd.Sum, name="orphan.waiting", process_set=pair) if R == 2 else None
    hvd.barrier()
    if R == 2:
        with check("rank 2 waits on the op while rank 0 removes the set: the error names rank 0 and the removal"):
            message = expect_error(RvodInternalError, "^rank 0 removed " + removed[1:], hvd.synchronize, handle)
            assert "called shutdown()" not in message, message
        with check("rank 2 removes the set afterwards as every rank must"):
            assert hvd.remove_process_set(pair) is True and pair.process_set_id is None
    else:
        with check("ranks 0 and 1 remove the set while rank 2 waits on its op"):
            time.sleep(0.5)  # rank 2 is inside synchronize by now
            assert hvd.remove_process_set(pair) is True and pair.process_set_id is None
    global_sum_works("a removal under a waiting op")

    with check("the same ranks make a set again (id 1) and it gives the right values"):
        again = hvd.add_process_set([0, 2])
        assert again.process_set_id == 1, again
        if again.included():
            out = hvd.allreduce(np.full(2, R + 1.0), op=hvd.Sum, name="again.sum", process_set=again)
            assert_equal(out, np.full(2, 4.0), "allreduce on the set added again")
    hvd.shutdown()
    finish(R)


{"static": static, "dynamic": dynamic, "naming": naming, "removal": removal}[MODE]()
