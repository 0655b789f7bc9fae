"""Error behaviour of rvod.numpy, one mode per job (first argument):

- ``main`` (rvodrun, 3 ranks, RVOD_STALL_CHECK_TIME_SECONDS=2): ops before init; mismatches of shape, dtype,
  reduce op, root rank and scale factors; a duplicate in-flight name; arguments refused at submission;
  a stalled allreduce; init -> shutdown -> init with the unnamed-op counter reset.
- ``kill SIGKILL|SIGSTOP [grouped|in-set]``: the last rank kills (or freezes) itself in the middle of a large
  allreduce (a grouped one with ``grouped``; with ``in-set``, before submitting one on the process set [1, 2] of a
  3-rank job, which rank 0 is no member of and sits out); the others report the error they got
  (``SURVIVOR <class> <seconds> <message>``).
- ``lifecycle`` (2 ranks): Ctrl-C while waiting; a peer that shuts down while this rank waits for it.
- ``steps``: a few plain collectives with known results (used while strangers poke at the job).
- ``single``: a job of size 1, started without rvodrun.
- ``dtype MODULE NAME``: a job of size 1 without rvodrun offers an array of dtype ``MODULE.NAME`` (e.g.
  ``ml_dtypes bfloat16``) to each op and prints what each raised (``REFUSED <op> <class> <message>``).
"""

import os
import re
import signal
import sys
import threading
import time

import numpy as np
import rvod.numpy as hvd
from _check import check, expect_error, finish, wait_done
from rvod.exceptions import RvodError, RvodInternalError, RvodMismatchError

MODE = sys.argv[1]




def not_initialized_checks(when):
    with check(f"{when}: is_initialized() is False"):
        assert hvd.is_initialized() is False
    for fn in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size):
        with check(f"{when}: {fn.__name__}() raises"):
            expect_error(ValueError, "init", fn)
    ops = [
        ("allreduce", lambda: hvd.allreduce(np.ones(2, dtype=np.float32))),
        ("allreduce_async", lambda: hvd.allreduce_async(np.ones(2, dtype=np.float32), name="x")),
        ("allreduce_", lambda: hvd.allreduce_(np.ones(2, dtype=np.float32))),
        ("grouped_allreduce", lambda: hvd.grouped_allreduce([np.ones(2, dtype=np.float32)])),
        ("allgather", lambda: hvd.allgather(np.ones(2, dtype=np.float32))),
        ("broadcast", lambda: hvd.broadcast(np.ones(2, dtype=np.float32), 0)),
        ("alltoall", lambda: hvd.alltoall(np.ones(6, dtype=np.float32))),
        ("reducescatter", lambda: hvd.reducescatter(np.ones(6, dtype=np.float32))),
        ("barrier", hvd.barrier),
        ("join", hvd.join),
        ("broadcast_object", lambda: hvd.broadcast_object({"a": 1})),
        ("allgather_object", lambda: hvd.allgather_object({"a": 1})),
    ]
    for label, call in ops:
        with check(f"{when}: {label} raises ValueError mentioning init"):
            message = expect_error(ValueError, "init", call)
            assert "hvd.init()" in message or "init()" in message, message


def allreduce_still_works(label):
    with check(f"allreduce after {label}"):
        out = hvd.allreduce(np.full(5, R + 1, dtype=np.int32), op=hvd.Sum, name=f"after.{label}")
        assert out.dtype == np.int32 and np.array_equal(out, np.full(5, N * (N + 1) // 2)), out


def mismatch(label, call, values, subject):
    """Every rank must raise RvodMismatchError naming `subject`, every rank, and every value in `values`."""
    with check(f"mismatch {label}"):
        try:
            call()
        except RvodMismatchError as error:
            assert isinstance(error, ValueError) and not isinstance(error, RvodInternalError)
            message = str(error)
        except Exception as error:
            raise AssertionError(f"expected RvodMismatchError, got {type(error).__name__}: {error}") from error
        else:
            raise AssertionError("no error raised")
        assert subject in message, f"{subject!r} not in {message!r}"
        for value in values:
            assert str(value) in message, f"{value!r} not in {message!r}"
        named = {int(r) for group in re.findall(r"ranks? ((?:\d+(?:, )?)+)", message) for r in group.split(", ")}
        assert named == set(range(N)), f"ranks named {sorted(named)} in {message!r}"
    allreduce_still_works(label)


def main():
    not_initialized_checks("before init")
    hvd.init()
    global R, N
    R, N = hvd.rank(), hvd.size()
    assert N == 3, "the main mode runs with 3 ranks"
    odd = R == 1  # the rank that disagrees

    # ---- mismatches: every rank raises, names the ranks and the values; the job goes on.
    mismatch("shape", lambda: hvd.allreduce(np.ones(3 if odd else 2, dtype=np.float32), name="mm.shape"),
             ["[2]", "[3]"], "allreduce.mm.shape")
    mismatch("shape 2-d", lambda: hvd.allreduce(np.ones((2, 3) if odd else (3, 2), dtype=np.float32),
                                                 name="mm.shape2"), ["[2, 3]", "[3, 2]"], "shape")
    mismatch("dtype", lambda: hvd.allreduce(np.ones(2, dtype=np.float64 if odd else np.float32), name="mm.dtype"),
             ["float32", "float64"], "data type")
    mismatch("reduce op", lambda: hvd.allreduce(np.ones(2, dtype=np.float32), op=hvd.Max if odd else hvd.Sum,
                                                name="mm.op"), ["Sum", "Max"], "mm.op")
    mismatch("root rank", lambda: hvd.broadcast(np.ones(2, dtype=np.float32), root_rank=2 if odd else 0,
                                                name="mm.root"), ["sent 0", "sent 2"], "root")
    mismatch("prescale", lambda: hvd.allreduce(np.ones(2, dtype=np.float32), op=hvd.Sum,
                                               prescale_factor=2.0 if odd else 1.0, name="mm.prescale"),
             ["prescale=2", "prescale=1"], "prescale")
    mismatch("postscale", lambda: hvd.allreduce(np.ones(2, dtype=np.float32), op=hvd.Sum,
                                                postscale_factor=0.5 if odd else 1.0, name="mm.postscale"),
             ["postscale=0.5", "postscale=1"], "postscale")
    mismatch("broadcast shape", lambda: hvd.broadcast(np.ones(4 if odd else 2, dtype=np.int8), 0, name="mm.bshape"),
             ["[2]", "[4]"], "shape")
    mismatch("allgather trailing shape", lambda: hvd.allgather(np.ones((2, 4 if odd else 3), dtype=np.int32),
                                                               name="mm.ag"), ["[3]", "[4]"], "allgather")
    mismatch("allgather dtype", lambda: hvd.allgather(np.ones(2, dtype=np.int64 if odd else np.int32),
                                                      name="mm.agdtype"), ["int32", "int64"], "data type")
    mismatch("reducescatter shape", lambda: hvd.reducescatter(np.ones(7 if odd else 6, dtype=np.float32),
                                                              name="mm.rs"), ["[6]", "[7]"], "reducescatter")
    mismatch("alltoall trailing shape", lambda: hvd.alltoall(np.ones((3, 2 if odd else 1), dtype=np.float32),
                                                             name="mm.a2a"), ["[1]", "[2]"], "alltoall")
    mismatch("async allreduce dtype", lambda: hvd.synchronize(hvd.allreduce_async(
        np.ones(2, dtype=np.int16 if odd else np.uint8), name="mm.async")), ["uint8", "int16"], "mm.async")
    # A grouped allreduce is packed into one tensor; members that differ are still named one by one, even
    # when the group's total size agrees.
    mismatch("grouped allreduce member shape", lambda: hvd.grouped_allreduce(
        [np.ones(3, dtype=np.float32), np.ones((2, 2) if odd else (4,), dtype=np.float32)], name="mm.grp"),
        ["[4]", "[2, 2]"], "'grouped_allreduce.mm.grp_1'")
    mismatch("grouped allreduce member count", lambda: hvd.grouped_allreduce(
        [np.ones(3, dtype=np.float32)] * (3 if odd else 2), name="mm.grpn"),
        ["2 tensors", "3 tensors"], "numbers of tensors in the group")
    mismatch("in-place allreduce shape", lambda: hvd.allreduce_(np.ones(1 if odd else 5, dtype=np.float32),
                                                                name="mm.inplace"), ["[1]", "[5]"], "shape")

    with check("a cached name whose shape then differs on one rank"):
        for step in range(3):
            x = np.ones(4 if step == 2 and odd else 3, dtype=np.float32)
            if step < 2:
                assert np.array_equal(hvd.allreduce(x, op=hvd.Sum, name="cached"), np.full(3, float(N)))
            else:
                message = expect_error(RvodMismatchError, r"rank 1 sent \[4\]", hvd.allreduce, x, op=hvd.Sum,
                                       name="cached")
                assert "ranks 0, 2 sent [3]" in message, message
        assert np.array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum, name="cached"), np.full(3, float(N)))

    # ---- the same name twice while the first is in flight: ValueError at submission, the first completes.
    with check("duplicate in-flight name"):
        x = np.full(1 << 16, R + 1, dtype=np.float32)
        if R != 0:
            time.sleep(1.0)
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="dup")
        if R == 0:
            assert hvd.poll(handle) is False
            expect_error(ValueError, r"same name.*'allreduce\.dup'", hvd.allreduce_async, x, op=hvd.Sum, name="dup")
            expect_error(ValueError, r"same name.*'allreduce\.dup'", hvd.allreduce_, x.copy(), op=hvd.Sum, name="dup")
        out = hvd.synchronize(handle)
        assert np.array_equal(out, np.full(1 << 16, N * (N + 1) / 2, dtype=np.float32))
    with check("a completed name can be used again"):
        out = hvd.allreduce(np.full(3, R, dtype=np.float32), op=hvd.Sum, name="dup")
        assert np.array_equal(out, np.full(3, N * (N - 1) / 2, dtype=np.float32))

    # ---- bad arguments: ValueError at submission, on this rank alone, nothing sent.
    x = np.arange(N * 2, dtype=np.float32)
    x_int = np.arange(N * 2, dtype=np.int32)
    read_only = np.ones(4, dtype=np.float32)
    read_only.flags.writeable = False
    refused = [
        ("allreduce Adasum of int32", ValueError, "Adasum.*int32", lambda: hvd.allreduce(x_int, op=hvd.Adasum)),
        ("allreduce_ Adasum of int32", ValueError, "Adasum.*int32",
         lambda: hvd.allreduce_(x_int.copy(), op=hvd.Adasum)),
        ("grouped_allreduce Adasum of int32", ValueError, "Adasum.*int32",
         lambda: hvd.grouped_allreduce([x, x_int], op=hvd.Adasum)),
        ("reducescatter Min", ValueError, "(?i)Reducescatter currently only supports Average and Sum",
         lambda: hvd.reducescatter(x, op=hvd.Min)),
        ("reducescatter Max", ValueError, "(?i)Reducescatter currently only supports Average and Sum",
         lambda: hvd.reducescatter(x, op=hvd.Max)),
        ("reducescatter Product", ValueError, "(?i)Reducescatter currently only supports Average and Sum",
         lambda: hvd.reducescatter(x, op=hvd.Product)),
        ("reducescatter Adasum", ValueError, "Adasum", lambda: hvd.reducescatter(x, op=hvd.Adasum)),
        ("reducescatter 0-d", ValueError, "dimension", lambda: hvd.reducescatter(np.zeros((), dtype=np.float32))),
        ("allgather 0-d", ValueError, "dimension", lambda: hvd.allgather(np.zeros((), dtype=np.float32))),
        ("alltoall uneven without splits", ValueError,
         "splits not provided, but first dimension of tensor is not an even multiple of the number of workers",
         lambda: hvd.alltoall(np.arange(N * 2 + 1, dtype=np.float32))),
        ("alltoall too few splits", ValueError, r"Number of entries in splits.*does not equal number of workers",
         lambda: hvd.alltoall(x, splits=[1] * (N - 1))),
        ("alltoall too many splits", ValueError, r"Number of entries in splits.*does not equal number of workers",
         lambda: hvd.alltoall(x, splits=[1] * (N + 1))),
        ("alltoall splits sum too large", ValueError,
         "Sum of splits entries is greater than the first dimension of tensor",
         lambda: hvd.alltoall(x, splits=[N * 2] * N)),
        ("alltoall negative split", ValueError, "negative", lambda: hvd.alltoall(x, splits=[-1] + [1] * (N - 1))),
        ("broadcast root_rank = size", ValueError, "root", lambda: hvd.broadcast(x, N)),
        ("broadcast root_rank = -1", ValueError, "root", lambda: hvd.broadcast(x, -1)),
        ("broadcast_ root_rank = size", ValueError, "root", lambda: hvd.broadcast_(x.copy(), N + 5)),
        ("broadcast_object root out of range", ValueError, "root", lambda: hvd.broadcast_object(1, root_rank=N)),
        ("unknown reduce op", ValueError, "op", lambda: hvd.allreduce(x, op=42)),
        ("op and average", ValueError, "op", lambda: hvd.allreduce(x, op=hvd.Sum, average=True)),
        ("empty grouped_allreduce", ValueError, "", lambda: hvd.grouped_allreduce([])),
        ("other process set", ValueError, "process set", lambda: hvd.allreduce(x, process_set=hvd.ProcessSet([0]))),
        ("complex64", TypeError, "complex64", lambda: hvd.allreduce(np.ones(2, dtype=np.complex64))),
        ("uint32", TypeError, "uint32", lambda: hvd.allreduce(np.ones(2, dtype=np.uint32))),
        ("uint64 allgather", TypeError, "uint64", lambda: hvd.allgather(np.ones(2, dtype=np.uint64))),
        ("object", TypeError, "object", lambda: hvd.broadcast(np.array([None, 1]), 0)),
        ("strings", TypeError, "dtype", lambda: hvd.allgather(np.array(["a", "b"]))),
        ("allreduce_ read-only", ValueError, "read-only", lambda: hvd.allreduce_(read_only)),
        ("allreduce_async_ read-only", ValueError, "read-only", lambda: hvd.allreduce_async_(read_only)),
        ("grouped_allreduce_ read-only", ValueError, "read-only",
         lambda: hvd.grouped_allreduce_([x.copy(), read_only])),
        ("broadcast_ read-only", ValueError, "read-only", lambda: hvd.broadcast_(read_only, 0)),
        ("allreduce_ of a list", TypeError, "array", lambda: hvd.allreduce_([1.0, 2.0])),
    ]
    for label, error_type, pattern, call in refused:
        with check(f"refused: {label}"):
            expect_error(error_type, pattern, call)
    allreduce_still_works("refused arguments")

    with check("read-only arrays are untouched"):
        assert np.array_equal(read_only, np.ones(4))

    # ---- a stalled allreduce: rank 0 (the coordinator) warns naming the tensor and rank 1; it still completes.
    with check("stalled allreduce completes"):
        if R == 1:
            time.sleep(4.5)
        out = hvd.allreduce(np.full(2, R, dtype=np.float64), op=hvd.Sum, name="stall")
        assert np.array_equal(out, np.full(2, N * (N - 1) / 2))
    allreduce_still_works("stall")

    # ---- re-init: the unnamed-op counter restarts, so ranks that issued different numbers of unnamed ops
    # before shutdown agree again after init. Rank 0 consumes one extra name with a refused op.
    with check("unnamed ops before shutdown"):
        out = hvd.allreduce(np.full(2, 1.0, dtype=np.float32), op=hvd.Sum)
        assert np.array_equal(out, np.full(2, float(N), dtype=np.float32))
        if R == 0:
            expect_error(ValueError, "Adasum", hvd.allreduce, np.ones(2, dtype=np.int32), op=hvd.Adasum)
    hvd.shutdown()
    not_initialized_checks("after shutdown")
    for cycle in range(2):
        hvd.init()
        with check(f"re-init {cycle}: topology"):
            assert (hvd.rank(), hvd.size()) == (R, N)
        with check(f"re-init {cycle}: unnamed allreduce matches on every rank (counter reset)"):
            handle = hvd.allreduce_async(np.full(2, R + cycle, dtype=np.float32), op=hvd.Sum)
            wait_done(hvd.poll, handle, timeout=10)
            out = hvd.synchronize(handle)
            assert np.array_equal(out, np.full(2, N * (N - 1) / 2 + N * cycle, dtype=np.float32)), out
        hvd.shutdown()
        with check(f"re-init {cycle}: shutdown"):
            assert hvd.is_initialized() is False
    hvd.shutdown()  # a second shutdown does nothing
    finish(R)


def survivor_report(fatal):
    """Runs `fatal` (a collective that fails) and prints the error it raised and when; whether it is an
    RvodInternalError."""
    start = time.monotonic()
    try:
        fatal()
    except RvodError as error:
        elapsed = time.monotonic() - start
        print(f"SURVIVOR {type(error).__name__} {elapsed:.2f} {str(error)!r}", flush=True)
        return isinstance(error, RvodInternalError)
    print("SURVIVOR no error", flush=True)
    return False


def kill():
    in_set = sys.argv[3:] == ["in-set"]
    process_set = hvd.ProcessSet([1, 2]) if in_set else hvd.global_process_set
    hvd.init(process_sets=[process_set] if in_set else None)
    rank, size = hvd.rank(), hvd.size()
    from rvod import _rvod

    print(f"TRANSPORT {_rvod.transport_kind()}", flush=True)
    victim = size - 1
    big = np.ones(32 << 20, dtype=np.float32)  # 128 MiB: takes far longer than the 10 ms before the kill
    for step in range(2):
        out = hvd.allreduce(big, op=hvd.Sum, name=f"step{step}")
        assert out[0] == size and out[-1] == size
        print(f"step {step} ok", flush=True)
    if in_set:
        # The victim dies before submitting (a set of two finishes 128 MiB over shared memory within 50 ms), so
        # rank 1 fails waiting for it; rank 0, no member, sits it out until the victim has died.
        if rank == victim:
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        if rank == 0:
            time.sleep(2.0)
            is_internal = True
        else:
            fatal = lambda: hvd.allreduce(big, op=hvd.Sum, name="fatal", process_set=process_set)  # noqa: E731
            is_internal = survivor_report(fatal)
    else:
        # Every rank submits the doomed op within microseconds of the others, so the victim dies or freezes
        # while its data moves, not while a late rank is still negotiating it (a rank still freeing the last
        # 128 MiB result could start more than the delay below after the victim; over TCP a survivor that
        # had waited on another survivor since long before could then time out a second or more before that
        # survivor's word naming the frozen rank was sent). Ranks that stall together time out together, and
        # a TCP survivor timing out on a silent peer waits a moment for that peer's word (see TcpTransport).
        hvd.barrier()
        if sys.argv[3:] == ["grouped"]:
            # 64 MiB in 16 tensors: over shared memory a grouped allreduce runs through the staging areas, fast
            # enough (tens of ms) that the victim dies 5 ms in, while packing or reducing.
            handle = hvd.grouped_allreduce_async(np.split(big[: 16 << 20], 16), op=hvd.Sum, name="fatal")
            delay = 0.005
        else:
            # 128 MiB on 3 ranks: tens of ms over shared memory on a quiet machine (out-of-place results no
            # longer copy their input first; with 50 ms here a fast run finished on rank 0 before the kill).
            handle = hvd.allreduce_async(big, op=hvd.Sum, name="fatal")
            delay = 0.01
        if rank == victim:
            time.sleep(delay)
            # SIGKILL: the connections close at once. SIGSTOP: the rank goes silent with its connections open
            # (the test kills it later), so only the RVOD_TIMEOUT deadline can notice.
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        is_internal = survivor_report(lambda: hvd.synchronize(handle))
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(2, dtype=np.float32), name="after")
    except RvodError as error:
        print(f"AFTER {type(error).__name__} {time.monotonic() - start:.2f} {str(error)!r}", flush=True)
    else:
        print("AFTER no error", flush=True)
    hvd.shutdown()
    print("shutdown done", flush=True)
    sys.exit(0 if is_internal else 1)


def lifecycle():
    """Ctrl-C while waiting, then one rank shutting down while the other waits for it."""
    hvd.init()
    rank = hvd.rank()
    if rank == 0:
        with check("SIGINT while waiting raises KeyboardInterrupt promptly"):
            timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            start = time.monotonic()
            try:
                hvd.allreduce(np.ones(4), name="never")  # rank 1 never submits it
            except KeyboardInterrupt:
                assert time.monotonic() - start < 2.0, f"took {time.monotonic() - start:.2f} s"
            else:
                raise AssertionError("allreduce returned")
    with check("collectives still work after the interrupt"):
        out = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, name="after.interrupt")
        assert np.array_equal(out, np.full(3, 3.0)), out
    if rank == 1:
        time.sleep(0.5)
        hvd.shutdown()
        time.sleep(1.0)  # still alive while rank 0 notices
    else:
        with check("a peer's shutdown fails a waiting collective with RvodInternalError"):
            start = time.monotonic()
            expect_error(RvodInternalError, "shut down", hvd.allreduce, np.ones(4), name="orphan")
            assert time.monotonic() - start < 5.0, f"took {time.monotonic() - start:.2f} s"
        with check("later collectives fail at once"):
            start = time.monotonic()
            expect_error(RvodInternalError, "", hvd.allreduce, np.ones(4), name="later")
            assert time.monotonic() - start < 1.0
        hvd.shutdown()
    finish(rank)


def steps():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for step in range(5):
        x = np.arange(1000, dtype=np.float64) + rank * step
        out = hvd.allreduce(x, op=hvd.Sum, name=f"s{step}")
        assert np.array_equal(out, size * np.arange(1000) + step * size * (size - 1) / 2), out[:5]
        time.sleep(0.1)
    gathered = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int32))
    assert gathered.shape == (size * (size + 1) // 2, 2)
    assert hvd.broadcast_object({"from": rank}, root_rank=size - 1) == {"from": size - 1}
    hvd.shutdown()
    print(f"rank {rank} of {size}: steps ok", flush=True)


def single():
    assert not any(k.startswith(("RVOD_RANK", "RVOD_SIZE", "HOROVOD_RANK")) for k in os.environ)
    not_initialized_checks("size 1 before init")
    hvd.init()
    with check("size-1 topology"):
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
        assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    with check("size-1 collectives"):
        for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
            out = hvd.allreduce(x, op=op)
            assert out.dtype == x.dtype and np.array_equal(out, x), (op, out)
        assert np.array_equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), x / 2)
        y = x.copy()
        assert hvd.allreduce_(y, op=hvd.Sum) is y and np.array_equal(y, x)
        assert [o.tolist() for o in hvd.grouped_allreduce([x, x[0]])] == [x.tolist(), x[0].tolist()]
        group = [x.copy(), np.arange(5, dtype=np.int64), x[0].copy()]
        assert hvd.grouped_allreduce_(group, op=hvd.Max) == group  # in place, unscaled: left as it is
        assert [g.tolist() for g in group] == [x.tolist(), list(range(5)), x[0].tolist()]
        hvd.grouped_allreduce_(group, op=hvd.Sum, prescale_factor=4.0, postscale_factor=0.5)
        assert [g.tolist() for g in group] == [(x * 2).tolist(), [0, 2, 4, 6, 8], (x[0] * 2).tolist()]
        burst = [np.full(3, i, dtype=np.float32) for i in range(8)]
        handles = [hvd.allreduce_async_(b, op=hvd.Average, name=f"burst.{i}") for i, b in enumerate(burst)]
        assert [hvd.synchronize(h) is b for h, b in zip(handles, burst)] == [True] * 8
        assert [b.tolist() for b in burst] == [[float(i)] * 3 for i in range(8)]
        assert np.array_equal(hvd.allgather(x), x)
        assert np.array_equal(hvd.broadcast(x, 0), x)
        assert np.array_equal(hvd.alltoall(x), x)
        out, splits = hvd.alltoall(x, splits=[4])
        assert np.array_equal(out, x) and [int(s) for s in splits] == [4]
        assert np.array_equal(hvd.reducescatter(x, op=hvd.Sum), x)
        hvd.barrier()
        assert hvd.join() == 0
        assert hvd.broadcast_object({"k": [1, 2]}) == {"k": [1, 2]}
        assert hvd.allgather_object("me") == ["me"]
        handle = hvd.allreduce_async(x, op=hvd.Sum)
        wait_done(hvd.poll, handle)
        assert np.array_equal(hvd.synchronize(handle), x)
    hvd.shutdown()
    hvd.init()
    with check("size-1 re-init"):
        assert hvd.size() == 1 and np.array_equal(hvd.allreduce(x), x)
    hvd.shutdown()
    finish(0)


def dtype():
    import importlib

    array = np.ones(4, dtype=getattr(importlib.import_module(sys.argv[2]), sys.argv[3]))
    hvd.init()
    calls = {
        "allreduce": lambda: hvd.allreduce(array, op=hvd.Sum),
        "allreduce_": lambda: hvd.allreduce_(array, op=hvd.Sum),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([array]),
        "allgather": lambda: hvd.allgather(array),
        "broadcast": lambda: hvd.broadcast(array, 0),
        "alltoall": lambda: hvd.alltoall(array),
        "reducescatter": lambda: hvd.reducescatter(array),
    }
    for op, call in calls.items():
        try:
            call()
        except Exception as error:  # noqa: BLE001 -- the test checks which class it was
            print(f"REFUSED {op} {type(error).__name__} {str(error)!r}", flush=True)
        else:
            print(f"REFUSED {op} nothing", flush=True)
    hvd.shutdown()


{"main": main, "kill": kill, "lifecycle": lifecycle, "steps": steps, "single": single, "dtype": dtype}[MODE]()
