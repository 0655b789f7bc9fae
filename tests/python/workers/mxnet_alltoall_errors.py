"""rvod.mxnet alltoall argument errors as a horovod.mxnet script catches them, run by rvodrun with 2 ranks:
Horovod's own error tests (MXNetError or RuntimeError; for float splits MXNetError or ValueError), with
rvod's messages, non-integer splits refused, and the job going on afterwards.
"""

import mxnet as mx
import numpy as np
from _check import check, expect_error, finish
from mxnet.base import MXNetError

import rvod.mxnet as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()


def horovod_catches(exceptions, call, *args):
    """What Horovod's test suite does: the call must raise one of ``exceptions``."""
    try:
        call(*args)
    except exceptions as error:
        return error
    raise AssertionError(f"{call.__name__} did not throw error")


with check("Horovod's test_horovod_alltoall_equal_split_length_error"):
    error = horovod_catches((MXNetError, RuntimeError), hvd.alltoall, mx.nd.empty([N + 1]))
    assert "splits not provided, but first dimension of tensor is not an even multiple" in str(error), error

with check("Horovod's test_horovod_alltoall_splits_error"):
    error = horovod_catches((MXNetError, RuntimeError), hvd.alltoall, mx.nd.empty([N - 1]),
                            mx.nd.ones([N], dtype="int32"))
    assert "Sum of splits entries is greater than the first dimension of tensor" in str(error), error

with check("Horovod's test_horovod_alltoall_splits_type_error"):
    error = horovod_catches((MXNetError, ValueError), hvd.alltoall, mx.nd.empty([N]), mx.nd.ones([N], dtype="float32"))
    assert "alltoall expects splits to contain integer elements, got an NDArray of float32" in str(error), error

with check("every alltoall argument error is an MXNetError and a ValueError, with a message naming the problem"):
    for splits, pattern in [
        ([1.5, 0.5], r"alltoall expects splits to be integers, got 1\.5 \(float\)"),
        ([1.0, 1.0], r"alltoall expects splits to be integers, got 1\.0 \(float\)"),
        ([True, False], r"alltoall expects splits to be integers, got True \(bool\)"),
        (np.array([1.0, 1.0]), r"alltoall expects splits to be integers, got 1\.0 \(float64\)"),
        (mx.nd.array([1, 1], dtype="float64"), "contain integer elements, got an NDArray of float64"),
        (2, "alltoall expects splits to be an integer NDArray or a list of ints, got int"),
        ([1], r"Number of entries in splits \(1\) does not equal number of workers \(2\)"),
        ([3, -1], "alltoall splits must not be negative"),
    ]:
        message = expect_error(MXNetError, pattern, hvd.alltoall, mx.nd.ones((2,)), splits)
        expect_error(ValueError, pattern, hvd.alltoall, mx.nd.ones((2,)), splits)
        assert message.count("alltoall") >= 1, message

with check("integer splits of any integer kind are taken; the job goes on after the errors"):
    splits_of = [[1, 2], [2, 1]]  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2, then 1
    rows_of = [np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * r for r in range(N)]
    expected = np.concatenate([rows_of[0][:1], rows_of[1][:2]] if R == 0 else [rows_of[0][1:], rows_of[1][2:]])
    for splits in (splits_of[R], np.array(splits_of[R], dtype=np.int64), mx.nd.array(splits_of[R], dtype="int64"),
                   mx.nd.array(splits_of[R], dtype="int32")):
        output, received = hvd.alltoall(mx.nd.array(rows_of[R]), splits)
        assert np.array_equal(output.asnumpy(), expected), (splits, output.asnumpy(), expected)
        assert received.dtype == np.int32 and received.asnumpy().tolist() == [splits_of[s][R] for s in range(N)]

finish(R)
