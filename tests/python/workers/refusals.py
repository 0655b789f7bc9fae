"""Refused and failed ops in the shim named on the command line (numpy, torch, tensorflow, keras, mxnet), run by
rvodrun with 2 ranks.

Every refusal at submission is an ``RvodInvalidArgumentError``, caught as ``ValueError`` and as ``RuntimeError``
(Horovod's callers catch ``RuntimeError``; for mxnet it is also an ``MXNetError``). A refused call moves no
default name: after refusals on one rank only, in several orders, the unnamed ops both ranks make still match
(a mix-up would raise a mismatch or hang, which the test's timeout catches). Horovod's join sequence: rank 0
joins, rank 1's allgather fails (it is not possible while a rank has joined), rank 1 joins, and then both
ranks' unnamed ``allgather_object`` and unnamed tensor ops match.
"""

import importlib
import sys
import time

import numpy as np
from _check import check, expect_error, finish

from rvod.exceptions import RvodInternalError, RvodInvalidArgumentError

FRAMEWORK = sys.argv[1]
hvd = importlib.import_module(f"rvod.{FRAMEWORK}")
hvd.init()
R, N = hvd.rank(), hvd.size()
assert N == 2, "run with 2 ranks"

if FRAMEWORK == "torch":
    import torch

    def tensor(values):
        return torch.tensor(values, dtype=torch.float32)
elif FRAMEWORK == "tensorflow":
    import tensorflow as tf

    def tensor(values):
        return tf.constant(values, dtype=tf.float32)
elif FRAMEWORK == "mxnet":
    import mxnet as mx

    def tensor(values):
        return mx.nd.array(values, dtype="float32")
else:
    def tensor(values):
        return np.asarray(values, dtype=np.float32)


def values(result):
    return np.asarray(result.asnumpy() if FRAMEWORK == "mxnet" else result).tolist()


REFUSED = (RvodInvalidArgumentError, ValueError, RuntimeError)
if FRAMEWORK == "mxnet":
    REFUSED += (mx.base.MXNetError,)


# What went wrong in refused calls, reported by the last check: a wrong error must not skip the collectives
# after it in its check (the other rank would wait for them).
problems = []


def refused(pattern, call, *args, **kwargs):
    """``call`` is refused at submission with an error of every class Horovod's callers and rvod's catch."""
    try:
        call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - checked below
        missing = [cls.__name__ for cls in REFUSED if not isinstance(error, cls)]
        if missing or pattern not in str(error):
            problems.append(f"{pattern!r}: {type(error).__name__} ({error}) is not a {missing} or says otherwise")
    else:
        problems.append(f"{pattern!r}: not refused")


def expect_failure(error_type, pattern, call, *args):
    """``expect_error`` that records what went wrong instead of raising."""
    try:
        expect_error(error_type, pattern, call, *args)
    except AssertionError as error:
        problems.append(str(error))


# Refusals this shim offers: (what the message says, the call); each is refused on one rank at a time below,
# so none may run a collective.
REFUSALS = [
    ("Reducescatter currently only supports Average and Sum", lambda: hvd.reducescatter(tensor([1.0, 2.0]), op=hvd.Adasum)),
    ("root_rank 7", lambda: hvd.broadcast(tensor([1.0]), root_rank=7)),
    ("The op parameter supersedes average", lambda: hvd.allreduce(tensor([1.0]), average=True, op=hvd.Sum)),
    ("allgather needs a tensor with at least one dimension", lambda: hvd.allgather(tensor(3.0))),
]
if FRAMEWORK != "tensorflow":  # tensorflow's grouped ops of no tensors return []
    REFUSALS.append(("grouped_allreduce needs at least one tensor", lambda: hvd.grouped_allreduce([])))
    if FRAMEWORK != "keras":
        REFUSALS.append(("grouped_allgather needs at least one tensor", lambda: hvd.grouped_allgather([])))
if FRAMEWORK != "keras":  # rvod.keras has allreduce, allgather, broadcast and reducescatter only
    REFUSALS.append(("Sum of splits entries is greater than the first dimension",
                     lambda: hvd.alltoall(tensor([1.0, 2.0]), splits=[2, 2])))
    # Groups refused once their names were taken.
    REFUSALS.append(("allgather needs a tensor with at least one dimension",
                     lambda: hvd.grouped_allgather([tensor([1.0]), tensor(3.0)])))
    REFUSALS.append(("Reducescatter currently only supports Average and Sum",
                     lambda: hvd.grouped_reducescatter([tensor([1.0, 2.0]), tensor([3.0, 4.0])], op=hvd.Adasum)))
if FRAMEWORK == "tensorflow":  # refused by the adapter, before the engine sees them
    REFUSALS.append(("tensors of dtype complex64 are not supported",
                     lambda: hvd.allreduce(tf.constant([1 + 2j], tf.complex64))))
    REFUSALS.append(("SparseTensor is not supported here",
                     lambda: hvd.broadcast(tf.sparse.from_dense(tf.constant([0.0, 1.0])), root_rank=0)))

with check(f"{FRAMEWORK}: every refusal at submission is an RvodInvalidArgumentError, ValueError and RuntimeError"):
    for pattern, call in REFUSALS:
        refused(pattern, call)
    if FRAMEWORK in ("numpy", "torch"):  # a name in flight on rank 1: rank 0 submits it a second later
        if R == 0:
            time.sleep(1)
        handle = hvd.allreduce_async(tensor([1.0]), name="dup")
        if R == 1:
            refused("same name as another tensor", hvd.allreduce_async, tensor([1.0]), name="dup")
        hvd.synchronize(handle)
    hvd.barrier() if FRAMEWORK != "keras" else hvd.allreduce(tensor([0.0]), name="sync")


def accepted(step):
    """An unnamed allreduce, allgather and broadcast both ranks make; each result says whether they matched."""
    assert values(hvd.allreduce(tensor([float(step + R)]), op=hvd.Sum)) == [2.0 * step + 1], step
    assert values(hvd.allgather(tensor([[float(step), float(R)]]))) == [[step, 0.0], [step, 1.0]], step
    assert values(hvd.broadcast(tensor([float(step + 10 * R)]), root_rank=1)) == [step + 10.0], step


# Orders of refused (on one rank) and accepted (on both) calls: each refusal in every position.
with check(f"{FRAMEWORK}: refusals on one rank, in any order, move no default name"):
    step = 0
    for refusing in range(N):
        for position in ("before", "between", "after"):
            for pattern, call in REFUSALS:
                if R == refusing and position == "before":
                    refused(pattern, call)
                accepted(step)
                step += 1
                if R == refusing and position == "between":
                    refused(pattern, call)
                    refused(pattern, call)
                accepted(step)
                step += 1
                if R == refusing and position == "after":
                    refused(pattern, call)
    # A refused op between accepted asynchronous ones (handles pending when it is refused).
    if FRAMEWORK in ("numpy", "torch"):
        first = hvd.allreduce_async(tensor([1.0 + R]), op=hvd.Sum)
        if R == 1:
            refused("root_rank 7", hvd.broadcast_async, tensor([1.0]), root_rank=7)
        second = hvd.allgather_async(tensor([float(R)]))
        assert values(hvd.synchronize(first)) == [3.0]
        assert values(hvd.synchronize(second)) == [0.0, 1.0]
    accepted(step)

if FRAMEWORK != "keras":  # no join or object helpers in rvod.keras (nor in horovod.keras)
    def allgather_object_refused():
        class Unpicklable:
            def __reduce__(self):
                raise TypeError("this object cannot be pickled")
        expect_failure(TypeError, "cannot be pickled", hvd.allgather_object, Unpicklable())

    with check(f"{FRAMEWORK}: refused object helpers and tensor ops move no object helper name"):
        if R == 1:
            allgather_object_refused()
            refused("root_rank 7", hvd.broadcast_object, {"x": 1}, root_rank=7)
            refused("Reducescatter currently only supports", hvd.reducescatter, tensor([1.0, 2.0]), op=hvd.Adasum)
        assert hvd.allgather_object(("rank", R)) == [("rank", 0), ("rank", 1)]
        assert hvd.broadcast_object({"root": R} if R == 0 else None, root_rank=0) == {"root": 0}
        if R == 0:
            refused("root_rank 7", hvd.broadcast_object, None, root_rank=7)
            allgather_object_refused()
        assert hvd.allgather_object(R * 2) == [0, 2]
        accepted(1000)

    with check(f"{FRAMEWORK}: after join, an allgather failed on one rank moves no name (Horovod's join sequence)"):
        if R == 0:
            ret = hvd.join()
        else:
            expect_failure(RuntimeError, "Allgather is not supported with Join", hvd.allgather,
                           tensor([[1.0] * 17] * 17))
            expect_failure(RvodInternalError, "Allgather is not supported with Join", hvd.allgather, tensor([1.0]))
            ret = hvd.join()
        ret = int(values(ret)) if FRAMEWORK == "tensorflow" else int(ret)
        assert ret == 1, ret
        assert hvd.allgather_object(ret) == [1, 1]
        assert hvd.broadcast_object(ret * 10 + R, root_rank=1) == 11
        accepted(2000)

    with check(f"{FRAMEWORK}: ranks that ran different numbers of unnamed ops before join match after it"):
        for step in range(3 if R == 0 else 1):
            assert values(hvd.allreduce(tensor([1.0]), op=hvd.Sum)) in ([2.0], [1.0]), step  # 1.0: the other joined
        hvd.join()
        accepted(3000)
        assert hvd.allgather_object(R) == [0, 1]

with check(f"{FRAMEWORK}: every refused call raised what it should"):
    assert not problems, "\n".join(problems)

finish(R)
