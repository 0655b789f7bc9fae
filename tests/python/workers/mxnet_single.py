"""rvod.mxnet in a job of one rank started without rvodrun: the DLPack round trip (zero copy in place,
results MXNet can use, results that outlive the engine) and what the training helpers do at size 1."""

import ctypes

import mxnet as mx
import numpy as np
from _check import check, finish
from mxnet import autograd, gluon

import rvod.mxnet as hvd

hvd.init()


def data_pointer(array):
    # MXNet allocates an array's memory when the op that fills it runs (asynchronously); asking for the
    # pointer before that races with the allocation and can give the array a second buffer.
    array.wait_to_read()
    pointer = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    return pointer.value


with check("a job of one rank: rank 0 of 1; every op returns its input's values"):
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_size()) == (0, 1, 0, 1, 1)
    x = mx.nd.array([[1, 2], [3, 4]], dtype="int32")
    for out in (hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x), hvd.allgather(x), hvd.broadcast(x, 0),
                hvd.alltoall(x), hvd.reducescatter(x, hvd.Sum), *hvd.grouped_allreduce([x], op=hvd.Max)):
        assert out.dtype == np.int32 and out.asnumpy().tolist() == [[1, 2], [3, 4]], out

with check("in place: the engine writes into the NDArray's own memory, and MXNet sees the result"):
    x = mx.nd.arange(6, dtype="float32")
    pointer = data_pointer(x)
    assert hvd.allreduce_(x, op=hvd.Sum, prescale_factor=2.0) is x
    assert data_pointer(x) == pointer
    assert (x + 1).asnumpy().tolist() == [1, 3, 5, 7, 9, 11]
    group = [mx.nd.ones((3,)), mx.nd.ones((2, 2), dtype="float64")]
    pointers = [data_pointer(t) for t in group]
    hvd.grouped_allreduce_(group, op=hvd.Sum, postscale_factor=3.0)
    assert [data_pointer(t) for t in group] == pointers and all((t == 3).asnumpy().all() for t in group)

with check("results are ordinary NDArrays: autograd, in-place MXNet ops, alive after shutdown"):
    out = hvd.allreduce(mx.nd.full((4,), 2.0), op=hvd.Sum)
    out.attach_grad()
    with autograd.record():
        y = (out * out).sum()
    y.backward()
    assert out.grad.asnumpy().tolist() == [4.0] * 4
    out += 1
    gathered = hvd.allgather(mx.nd.ones((2, 3)))
    hvd.shutdown()
    assert out.asnumpy().tolist() == [3.0] * 4 and gathered.sum().asscalar() == 6.0
    hvd.init()

with check("an array MKL-DNN keeps in its blocked layout after inference crosses in the plain layout"):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"), gluon.nn.Conv2D(32, 3, padding=1))
    net.hybridize()
    net.initialize(mx.init.Xavier())
    for rows in (4, 4, 256):  # inference leaves the second convolution's weight in MKL-DNN's layout
        net(mx.nd.ones((rows, 1, 8, 8)))
    mx.nd.waitall()  # the layout changes once the queued inference has run
    weight = net[1].weight.data()
    try:
        weight.to_dlpack_for_read()
        raise AssertionError("the weight is not in MKL-DNN's layout: this check tests nothing")
    except mx.base.MXNetError as error:
        assert "MKLDNN" in str(error), error
    reduced = hvd.allreduce(weight, op=hvd.Sum)  # straight after the check: nothing else touched the weight
    expected = weight.asnumpy()
    assert np.array_equal(reduced.asnumpy(), expected) and np.array_equal(hvd.broadcast_(weight, 0).asnumpy(), expected)
    assert net(mx.nd.ones((2, 1, 8, 8))).shape == (2, 32, 8, 8)

with check("size 1: broadcast_parameters does nothing (no hook on deferred parameters); the trainer and the "
           "optimizer wrapper neither reduce nor rescale"):
    net = gluon.nn.Dense(2)
    net.initialize()
    hvd.broadcast_parameters(net.collect_params())
    assert not any(hasattr(p, "_rvod_init_impl") for p in net.collect_params().values())
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     gradient_predivide_factor=3.0)
    net(mx.nd.ones((1, 3)))
    before = net.weight.data().copy()
    with autograd.record():
        loss = net(mx.nd.ones((2, 3))).sum()
    loss.backward()
    trainer.step(2)
    assert trainer._scale == 1.0
    assert np.allclose(net.weight.data().asnumpy(), before.asnumpy() - 0.1), net.weight.data()
    optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=0.5), gradient_predivide_factor=3.0)
    assert optimizer.rescale_grad == 0.5

hvd.shutdown()
finish(0)
