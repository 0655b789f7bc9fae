"""Engine behaviour a Horovod script relies on (issue 13), one mode per job (first argument):

- ``join`` (2 ranks): while rank 1 has joined, allgather (fresh and from the response cache), broadcast,
  alltoall and reducescatter raise at once on rank 0 with Horovod's messages, and both ranks stay in step
  for the next join; ``hvd.join(device)`` with an integer device on CPU behaves as ``join()``.
- ``scale`` (2 ranks): prescale/postscale on every dtype, for allreduce, grouped allreduce, reducescatter and
  grouped reducescatter (NumPy and PyTorch), against Horovod's formula: integers scaled in float64 and
  truncated back, float16 in float32, float32 with the factor rounded to float32.
- ``names`` (2 ranks): two different ops under one name raise RvodMismatchError on both ranks naming both
  ops; a duplicate in-flight reducescatter name raises ValueError and the job goes on.
- ``uint16`` (2 ranks): uint16 reduced, gathered, broadcast and exchanged through NumPy, PyTorch and
  TensorFlow (MXNet 1.9 has no uint16).
- ``exit`` (LocalJob, 2 ranks): rank 1 raises after init() without calling shutdown(); rank 0's pending
  allreduce fails saying rank 1 exited.
- ``stall`` (2 ranks): rank 1 holds back a fresh and a cached tensor; rank 0 reports when its op failed.
- ``init_only`` (LocalJob): init() and report how it ended (the test plays the other rank).
- ``never_maps`` (rvodrun): the last rank plays a rank that never maps the shared-memory segment, so the
  others stay in init() with the segment created, until the test stops the job.
- ``reinit`` (3 ranks): init() fails without timing out (a bad setting on every rank, on rank 1 only,
  process sets that differ across ranks, a set naming a rank outside the job), then init() again works and
  collectives give the right values.
- ``late`` (LocalJob, 2 ranks, rank 1 started late): rank 0's init() times out naming rank 1, then a
  second init() meets rank 1 and collectives work.
"""

import os
import sys
import time

import numpy as np
import rvod.numpy as hvd
from _check import check, expect_error, finish
from rvod.exceptions import RvodError, RvodInternalError, RvodMismatchError, RvodTimeoutError

MODE = sys.argv[1]


def timed_error(error_type, pattern, call, within=3.0):
    start = time.monotonic()
    message = expect_error(error_type, pattern, call)
    elapsed = time.monotonic() - start
    assert elapsed < within, f"took {elapsed:.1f} s to fail: {message}"
    return message


def join_mode():
    import rvod.torch as hvd_torch
    hvd.init()
    r = hvd.rank()
    expected = {
        "allgather": r"^Allgather is not supported with Join at this time\. Specify sparse_to_dense=True if using "
                     r"DistributedOptimizer \(tensor 'allgather\.{name}'; rank 1 joined",
        "broadcast": r"^Broadcast is not supported with Join at this time\. \(tensor 'broadcast\.{name}'",
        "alltoall": r"^Alltoall is not supported with Join at this time\. \(tensor 'alltoall\.{name}'",
        "reducescatter": r"^Reducescatter is not supported with Join at this time\. \(tensor 'reducescatter\.{name}'",
    }
    for round_ in range(2):
        # The name is in the response cache by now (a cached hit takes another path through negotiation).
        for _ in range(2):
            with check(f"round {round_}: allgather before join"):
                out = hvd.allgather(np.full(2, r, np.float32), name="cached")
                assert np.array_equal(out, np.array([0, 0, 1, 1], np.float32)), out
        if r == 1:
            with check(f"round {round_}: join(device) with an integer device on CPU behaves as join()"):
                last = hvd_torch.join(hvd_torch.local_rank()) if round_ == 0 else hvd.join()
                assert last == 0, last
        else:
            x = np.arange(4, dtype=np.float32)
            calls = {
                "allgather": lambda name: hvd.allgather(x, name=name),
                "broadcast": lambda name: hvd.broadcast(x, 0, name=name),
                "alltoall": lambda name: hvd.alltoall(x, name=name),
                "reducescatter": lambda name: hvd.reducescatter(x, name=name),
            }
            time.sleep(0.3)  # rank 1 has joined by now
            with check(f"round {round_}: cached allgather raises at once while rank 1 has joined"):
                timed_error(RvodInternalError, expected["allgather"].format(name="cached"),
                            lambda: hvd.allgather(x, name="cached"))
            for op, call in calls.items():
                with check(f"round {round_}: {op} raises at once with Horovod's message while rank 1 has joined"):
                    name = f"j{round_}"
                    timed_error(RvodInternalError, expected[op].format(name=name), lambda: call(name))
            with check(f"round {round_}: allreduce still runs with the joined rank contributing zeros"):
                out = hvd.allreduce(np.full(3, 2.0), op=hvd.Sum, name=f"ar{round_}")
                assert np.array_equal(out, np.full(3, 2.0)), out
            with check(f"round {round_}: the next join completes on both ranks"):
                assert hvd_torch.join() == 0
    with check("collectives after the joins"):
        out = hvd.allreduce(np.full(2, r + 1.0), op=hvd.Sum, name="after")
        assert np.array_equal(out, np.full(2, 3.0)), out
    hvd.shutdown()
    finish(r)


# ------------------------------------------------------------------------------------------ scale factors

NUMPY_DTYPES = ["uint8", "uint16", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


def horovod_scaled(x, factor):
    """Horovod's CPU ScaleBuffer: (T)(factor * x), in float64 for integers and float64, in float32 (the
    factor rounded to float32) for float32 and float16."""
    dtype = x.dtype
    if dtype.kind in "iu":
        return np.trunc(np.float64(factor) * x.astype(np.float64)).astype(dtype)
    if dtype == np.float64:
        return np.float64(factor) * x
    return (np.float32(factor) * x.astype(np.float32)).astype(dtype)


def reference(inputs, op, prescale, postscale, size):
    """What every rank must get: each rank's input prescaled, summed in the dtype, postscaled (Average:
    postscale / size, in float64 first, as Horovod divides the factor)."""
    total = None
    for x in inputs:
        scaled = horovod_scaled(x, prescale)
        total = scaled if total is None else (total + scaled).astype(x.dtype)
    post = postscale / size if op == hvd.Average else postscale
    return horovod_scaled(total, post)


def rank_input(dtype, rank, shape):
    """Values whose scaled sums stay in range (out of range, Horovod's C++ cast is undefined)."""
    rng = np.random.RandomState(1234 + rank)
    dtype = np.dtype(dtype)
    high = 25 if dtype.itemsize == 1 else 100
    if dtype.kind in "iu":
        return rng.randint(0 if dtype.kind == "u" else -high, high, size=shape).astype(dtype)
    return rng.uniform(-100, 100, size=shape).astype(dtype)


def scale_mode():
    import torch
    import rvod.torch as hvd_torch
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    factors = [(0.1, 1.0), (1.0, 1 / 3), (0.7310585786300049, 2.5), (1 / 3, 0.1)]
    torch_dtypes = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
                    "int64": torch.int64, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
    for dtype in NUMPY_DTYPES:
        for prescale, postscale in factors:
            for op in (hvd.Sum, hvd.Average):
                inputs = [rank_input(dtype, k, (4 * n, 3)) for k in range(n)]
                full = reference(inputs, op, prescale, postscale, n)
                mine = full[r * 4:(r + 1) * 4]
                kw = dict(op=op, prescale_factor=prescale, postscale_factor=postscale)
                label = f"{dtype} pre={prescale:.3g} post={postscale:.3g} op={op}"
                x = inputs[r]
                cases = [
                    ("allreduce", lambda: hvd.allreduce(x, **kw), full),
                    ("grouped_allreduce", lambda: hvd.grouped_allreduce([x, x[:2]], **kw), [full, None]),
                    ("reducescatter", lambda: hvd.reducescatter(x, **kw), mine),
                    ("grouped_reducescatter", lambda: hvd.grouped_reducescatter([x, x], **kw), [mine, mine]),
                ]
                if dtype in torch_dtypes:
                    t = torch.from_numpy(x.copy())
                    as_np = lambda out: [o.numpy() for o in out] if isinstance(out, list) else out.numpy()  # noqa: E731
                    cases += [
                        ("torch allreduce", lambda: as_np(hvd_torch.allreduce(t, **kw)), full),
                        ("torch grouped_allreduce", lambda: as_np(hvd_torch.grouped_allreduce([t], **kw)), [full]),
                        ("torch reducescatter", lambda: as_np(hvd_torch.reducescatter(t, **kw)), mine),
                        ("torch grouped_reducescatter", lambda: as_np(hvd_torch.grouped_reducescatter([t], **kw)),
                         [mine]),
                    ]
                for what, call, want in cases:
                    with check(f"{what} {label}"):
                        got = call()
                        if what.endswith("grouped_allreduce") and want[-1] is None:
                            want = [full, reference([k[:2] for k in inputs], op, prescale, postscale, n)]
                        gots, wants = (got, want) if isinstance(want, list) else ([got], [want])
                        for g, w in zip(gots, wants):
                            assert g.dtype == w.dtype, (g.dtype, w.dtype)
                            bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
                            assert bad.size == 0, (f"{bad.size} of {w.size} elements differ, first at {bad[0]}: "
                                                   f"got {g.reshape(-1)[bad[0]]!r}, want {w.reshape(-1)[bad[0]]!r}")
    hvd.shutdown()
    finish(r)


# ------------------------------------------------------------------------------------------ names

def names_mode():
    import torch
    import rvod.torch as hvd_torch
    hvd.init()
    r = hvd.rank()
    for _ in range(2):  # "cached.same" is in the response cache: rank 0's next allreduce of it is a cache hit
        hvd.allreduce(np.ones(2), name="cached.same")
    for label, mine, theirs in [
        ("allreduce vs allgather", lambda: hvd.allreduce(np.ones(2), name="same"),
         lambda: hvd.allgather(np.ones(2), name="same")),
        ("allreduce (cached) vs allgather", lambda: hvd.allreduce(np.ones(2), name="cached.same"),
         lambda: hvd.allgather(np.ones(2), name="cached.same")),
        ("broadcast vs reducescatter", lambda: hvd.broadcast(np.ones(4), 0, name="same2"),
         lambda: hvd.reducescatter(np.ones(4), name="same2")),
    ]:
        ops = [op.split()[0] for op in label.split(" vs ")]
        with check(f"{label} under one name: RvodMismatchError naming both ops on every rank"):
            message = timed_error(RvodMismatchError, r"Mismatched operations", mine if r == 0 else theirs, within=5)
            assert f"rank 0 sent {ops[0]}" in message and f"rank 1 sent {ops[1]}" in message, message
        with check(f"allreduce after {label}"):
            assert np.array_equal(hvd.allreduce(np.full(2, r + 1.0), op=hvd.Sum, name="ok"), np.full(2, 3.0))

    for shim, submit, value in [
        ("numpy", lambda name: hvd.reducescatter_async(np.full(1 << 16, 1.0, np.float32), name=name), None),
        ("torch", lambda name: hvd_torch.reducescatter_async(torch.full((1 << 16,), 1.0), name=name), None),
    ]:
        with check(f"{shim}: a duplicate in-flight reducescatter name raises ValueError; the first completes"):
            if r == 1:
                time.sleep(1.0)
            handle = submit(f"dup.{shim}")
            if r == 0:
                expect_error(ValueError, r"same name.*'reducescatter\.dup\." + shim, submit, f"dup.{shim}")
            out = (hvd if shim == "numpy" else hvd_torch).synchronize(handle)
            assert out.shape == (1 << 15,), out.shape
        with check(f"{shim}: the job goes on after the duplicate name"):
            assert np.array_equal(hvd.allreduce(np.full(2, r + 1.0), op=hvd.Sum, name=f"after.{shim}"),
                                  np.full(2, 3.0))
    with check("Horovod's duplicate-name test for reducescatter: each rank in turn, barriers in between"):
        # Each rank's name stays in flight during its turn (the other rank submits it only afterwards).
        tensor = torch.ones(17, 17)
        handles = {}
        for turn in (0, 1):
            if r == turn:
                handles[turn] = hvd_torch.reducescatter_async(tensor, name=f"duplicate_name.{turn}")
                for _ in range(10):
                    expect_error(ValueError, "same name", hvd_torch.reducescatter_async, tensor,
                                 name=f"duplicate_name.{turn}")
            hvd_torch.barrier()
        handles[1 - r] = hvd_torch.reducescatter_async(tensor, name=f"duplicate_name.{1 - r}")
        for handle in handles.values():
            assert hvd_torch.synchronize(handle).shape == (9 - r, 17)
        assert np.array_equal(hvd.allreduce(np.full(2, r + 1.0), op=hvd.Sum, name="after.horovod"), np.full(2, 3.0))
    hvd.shutdown()
    finish(r)


# ------------------------------------------------------------------------------------------ uint16

def uint16_mode():
    import torch
    import rvod.torch as hvd_torch
    hvd.init()
    r = hvd.rank()
    x = np.array([65535 - r, 40000, r, 7], dtype=np.uint16)
    with check("numpy uint16 allreduce Sum wraps, Max and Min unsigned"):
        out = hvd.allreduce(x, op=hvd.Sum, name="u16.sum")
        assert out.dtype == np.uint16 and out.tolist() == [65533, 14464, 1, 14], out
    with check("numpy uint16 Max/Min"):
        assert hvd.allreduce(x, op=hvd.Max, name="u16.max").tolist() == [65535, 40000, 1, 7]
        assert hvd.allreduce(x, op=hvd.Min, name="u16.min").tolist() == [65534, 40000, 0, 7]
    with check("numpy uint16 allgather, broadcast, alltoall, reducescatter"):
        assert hvd.allgather(x[:2], name="u16.ag").tolist() == [65535, 40000, 65534, 40000]
        assert hvd.broadcast(x, 1, name="u16.b").tolist() == [65534, 40000, 1, 7]
        out = hvd.alltoall(np.array([10 * r, 10 * r + 1], np.uint16), name="u16.a2a")
        assert out.dtype == np.uint16 and out.tolist() == [r, 10 + r], out
        out = hvd.reducescatter(np.full(4, 30000, np.uint16), op=hvd.Sum, name="u16.rs")
        assert out.dtype == np.uint16 and out.tolist() == [60000, 60000], out
    if hasattr(torch, "uint16"):
        t = torch.tensor([65535 - r, 40000, r, 7], dtype=torch.uint16)
        with check("torch uint16 allreduce, allgather, broadcast, alltoall"):
            out = hvd_torch.allreduce(t, op=hvd_torch.Max, name="t16.max")
            assert out.dtype == torch.uint16 and out.to(torch.int32).tolist() == [65535, 40000, 1, 7], out
            out = hvd_torch.allgather(t[:1], name="t16.ag")
            assert out.dtype == torch.uint16 and out.to(torch.int32).tolist() == [65535, 65534], out
            out = hvd_torch.broadcast(t, 1, name="t16.b")
            assert out.to(torch.int32).tolist() == [65534, 40000, 1, 7], out
            out = hvd_torch.alltoall(torch.tensor([10 * r, 10 * r + 1], dtype=torch.uint16), name="t16.a2a")
            assert out.dtype == torch.uint16 and out.to(torch.int32).tolist() == [r, 10 + r], out
    import tensorflow as tf
    import rvod.tensorflow as hvd_tf
    with check("tensorflow uint16 allreduce, allgather, broadcast, alltoall"):
        t = tf.constant([65535 - r, 40000, r, 7], tf.uint16)
        out = hvd_tf.allreduce(t, op=hvd_tf.Sum, name="tf16.sum")
        assert out.dtype == tf.uint16 and out.numpy().tolist() == [65533, 14464, 1, 14], out
        out = hvd_tf.allgather(t[:1], name="tf16.ag")
        assert out.dtype == tf.uint16 and out.numpy().tolist() == [65535, 65534], out
        assert hvd_tf.broadcast(t, 1, name="tf16.b").numpy().tolist() == [65534, 40000, 1, 7]
        out = hvd_tf.alltoall(tf.constant([10 * r, 10 * r + 1], tf.uint16), name="tf16.a2a")
        assert out.dtype == tf.uint16 and out.numpy().tolist() == [r, 10 + r], out
    hvd.shutdown()
    finish(r)


# ------------------------------------------------------------------------------------------ exits and starts

def exit_mode():
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(0.5)
        raise RuntimeError("rank 1's script failed")  # no shutdown(): the exit handler stops the engine
    try:
        hvd.allreduce(np.ones(2), name="never")
    except RvodError as error:
        print(f"ERROR {type(error).__name__}: {error}", flush=True)
    hvd.shutdown()


def late_mode():
    if int(os.environ["RVOD_RANK"]) == 1:
        hvd.init()
    else:
        start = time.monotonic()
        try:
            hvd.init()
        except RvodTimeoutError as error:
            print(f"FIRST INIT {time.monotonic() - start:.1f} {error}", flush=True)
        else:
            print("FIRST INIT succeeded", flush=True)
        print("READY", flush=True)
        hvd.init()
    out = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum, name="after")
    print(f"RESULT {out.tolist()}", flush=True)
    hvd.shutdown()


def stall_mode():
    """Rank 1 holds back a tensor (fresh, then one already in the response cache) that rank 0 submitted;
    rank 0 reports when it submitted and when its op failed."""
    hvd.init()
    r = hvd.rank()
    for label in ("fresh", "cached"):
        name = f"stall.{label}"
        if label == "cached":
            for _ in range(2):
                hvd.allreduce(np.ones(2), name=name)
        if r == 0:
            start = time.time()
            try:
                hvd.allreduce(np.ones(2), name=name)
            except RvodInternalError as error:
                print(f"STALL {label} {start:.3f} {time.time():.3f} {error}", flush=True)
        else:
            time.sleep(6.5)
        hvd.barrier()
    hvd.shutdown()


def init_only_mode():
    try:
        hvd.init()
    except RvodError as error:
        print(f"INIT FAILED {type(error).__name__}: {error}", flush=True)
    else:
        print("INIT SUCCEEDED", flush=True)
        hvd.shutdown()


def never_maps_mode():
    """The last rank plays a rank that comes to init() and never maps the shared-memory segment (it says
    in the store what init() says, then sleeps); the others call init(), which waits for it."""
    rank, size = int(os.environ["RVOD_RANK"]), int(os.environ["RVOD_SIZE"])
    if rank < size - 1:
        init_only_mode()
        return
    from rvod._rvod import StoreClient

    store = StoreClient(os.environ["RVOD_RENDEZVOUS_ADDR"], int(os.environ["RVOD_RENDEZVOUS_PORT"]),
                        bytes.fromhex(os.environ["RVOD_SECRET"]), 10.0)
    boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
    store.set(f"init0/arrived/{rank}", b"1")
    store.set(f"init0/host/{rank}", f"{os.environ['RVOD_LOCAL_SIZE']} {os.environ['RVOD_HOSTNAME']}".encode())
    store.set(f"init0/set1/host/{rank}", f"{os.environ['RVOD_HOSTNAME']}/{boot_id}".encode())
    time.sleep(120)


def reinit_mode():
    """init() that fails without timing out, then a second init() with the mistake fixed, four ways."""
    rank, size = int(os.environ["RVOD_RANK"]), int(os.environ["RVOD_SIZE"])
    assert size == 3, "the reinit mode runs with 3 ranks"

    def second_init_works(label, process_sets=None):
        with check(f"{label}: the second init() succeeds and collectives give the right values"):
            hvd.init(process_sets=process_sets)
            assert hvd.is_initialized() and (hvd.rank(), hvd.size()) == (rank, size)
            out = hvd.allreduce(np.arange(5.0) * (rank + 1), op=hvd.Sum, name=f"{label}.sum")
            assert np.array_equal(out, np.arange(5.0) * 6), out
            gathered = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int32), name=f"{label}.gather")
            assert np.array_equal(gathered, np.concatenate([np.full((r + 1, 2), r, dtype=np.int32) for r in range(3)]))
            assert hvd.broadcast_object({"from": rank}, root_rank=2) == {"from": 2}
            for ps in process_sets or []:
                if ps.included():
                    out = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, name=f"{label}.set", process_set=ps)
                    assert np.array_equal(out, np.full(3, sum(r + 1.0 for r in ps.ranks))), out
        hvd.shutdown()

    os.environ["RVOD_TIMEOUT"] = "soon"
    with check("a bad setting on every rank: ValueError naming it, at once, and nothing started"):
        timed_error(ValueError, r'RVOD_TIMEOUT="soon"', hvd.init, within=1.0)
        assert not hvd.is_initialized()
    del os.environ["RVOD_TIMEOUT"]
    second_init_works("bad setting on every rank")

    if rank == 1:
        os.environ["RVOD_TIMEOUT"] = "soon"
        with check("a bad setting on rank 1 only: its init() fails while the others wait for it"):
            timed_error(ValueError, r'RVOD_TIMEOUT="soon"', hvd.init, within=1.0)
        del os.environ["RVOD_TIMEOUT"]
    second_init_works("bad setting on rank 1")

    if rank == 1:
        address = os.environ["RVOD_RENDEZVOUS_ADDR"]
        os.environ["RVOD_RENDEZVOUS_ADDR"] = "no-such-host.invalid"
        with check("rank 1's rendezvous address does not resolve: RvodInternalError naming it, while the others wait"):
            timed_error(RvodInternalError, "cannot resolve rendezvous address no-such-host.invalid", hvd.init, within=5.0)
        os.environ["RVOD_RENDEZVOUS_ADDR"] = address
    second_init_works("rank 1 could not resolve the store's address")

    with check("ranks that register different process sets: ValueError on every rank, not a timeout"):
        mine = [hvd.ProcessSet([1, 2] if rank == 2 else [0, 1])]
        timed_error(ValueError, "registered different process sets", lambda: hvd.init(process_sets=mine), within=10.0)
        assert not hvd.is_initialized() and mine[0].process_set_id is None
    second_init_works("different process sets", [hvd.ProcessSet([0, 2])])

    with check("a process set naming a rank outside the job: ValueError on every rank, after connecting"):
        outside = [hvd.ProcessSet([0, 5])]
        timed_error(ValueError, r"process set ranks must be in 0\.\.3; got rank 5", lambda: hvd.init(process_sets=outside),
                    within=10.0)
        assert not hvd.is_initialized()
    second_init_works("a rank outside the job", [hvd.ProcessSet([1, 2])])
    finish(rank)


{"stall": stall_mode, "init_only": init_only_mode, "join": join_mode, "scale": scale_mode, "names": names_mode, "uint16": uint16_mode, "exit": exit_mode,
 "late": late_mode, "never_maps": never_maps_mode, "reinit": reinit_mode}[MODE]()
