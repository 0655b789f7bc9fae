"""Data-parallel MXNet training with rvod.mxnet, checked step by step against one process on the full batch.

Each rank trains on its shard of every batch with DistributedTrainer (Gluon) or DistributedOptimizer
(Module API); in the same process a reference model trains on the whole batch with the plain Trainer or
Module. After every step the parameters must be identical on all ranks and equal (within rounding) to the
reference's. Also: broadcast_parameters of deferred-initialized and of initialized Gluon parameters and of
Module parameters, the trainer's options (gradient_predivide_factor, num_groups, prefix, fp16 compression,
frozen parameters, allreduce_grads + update), the optimizer wrapper's attributes, and the argument errors.
Run by rvodrun with 2 ranks (any size works).
"""

import warnings

import mxnet as mx
import numpy as np
from _check import check, expect_error, finish
from mxnet import autograd, gluon

import rvod.mxnet as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
PER_RANK = 4
BATCH = PER_RANK * N
SHARD = slice(R * PER_RANK, (R + 1) * PER_RANK)
STEPS = 3


def batch(step, dtype="float64"):
    """The full batch of a step (the same on every rank): 8x8 one-channel images and labels in 0..2."""
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(BATCH, 1, 8, 8))
    y = rng.integers(0, 3, size=BATCH)
    return mx.nd.array(x, dtype=dtype), mx.nd.array(y, dtype=dtype)


def make_net(dtype="float64", seed=None, in_units=False):
    """A small CNN; its first layers' shapes are inferred at the first forward pass (deferred init) unless
    ``in_units``. ``seed`` makes the initial values reproducible."""
    if seed is not None:
        mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, activation="relu", in_channels=1 if in_units else 0),
            gluon.nn.MaxPool2D(2), gluon.nn.Flatten(),
            gluon.nn.Dense(8, activation="tanh", in_units=64 if in_units else 0), gluon.nn.Dense(3, in_units=8))
    net.cast(dtype)
    net.initialize(mx.init.Xavier())
    return net


def values(net):
    """The parameters' values in creation order, as NumPy."""
    return [p.data().asnumpy() for p in net.collect_params().values()]


def same_on_every_rank(arrays, label):
    """Every rank holds exactly rank 0's values."""
    for i, array in enumerate(arrays):
        root = hvd.broadcast(mx.nd.array(array, dtype=array.dtype), 0, name=f"same.{label}.{i}").asnumpy()
        assert np.array_equal(root, array), f"{label}: parameter {i} differs from rank 0's"


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def reference_like(net, dtype):
    """A model with the same architecture and the same current values as ``net`` (one process)."""
    reference = make_net(dtype)
    reference(batch(0, dtype)[0][:1])
    for target, source in zip(reference.collect_params().values(), net.collect_params().values()):
        target.set_data(source.data())
    return reference


def train_and_compare(make_trainer, optimizer, optimizer_params, label, dtype="float64", tolerance=1e-12,
                      frozen=(), manual_reduce=False):
    """Trains a broadcast model on shards and a reference on full batches; compares after every step."""
    net = make_net(dtype, seed=10 + R)  # different initial values on every rank; the broadcast aligns them
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"{label}.")
    net(batch(0, dtype)[0][:1])
    same_on_every_rank(values(net), f"{label}.init")
    reference = reference_like(net, dtype)
    for position in frozen:
        for model in (net, reference):
            list(model.collect_params().values())[position].grad_req = "null"
    trainer = make_trainer(net.collect_params(), optimizer, optimizer_params)
    ref_trainer = gluon.Trainer(reference.collect_params(), optimizer, optimizer_params, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    frozen_before = [values(net)[p] for p in frozen]
    for step in range(STEPS):
        x, y = batch(step, dtype)
        with autograd.record():
            loss = loss_fn(net(x[SHARD]), y[SHARD])
        loss.backward()
        if manual_reduce:
            trainer.allreduce_grads()
            trainer.update(PER_RANK)
        else:
            trainer.step(PER_RANK)
        with autograd.record():
            ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_trainer.step(BATCH)
        same_on_every_rank(values(net), f"{label}.{step}")
        difference = max_difference(values(net), values(reference))
        assert difference < tolerance, f"{label}: step {step} differs from the full batch by {difference}"
    for p, before in zip(frozen, frozen_before):
        assert np.array_equal(values(net)[p], before), f"{label}: frozen parameter {p} changed"
    return trainer


# -------------------------------------------------------------------------------------- broadcast_parameters

with check("broadcast_parameters: deferred-initialized Gluon parameters get rank 0's initial values"):
    rank0 = make_net(seed=10)
    rank0(batch(0)[0][:1])
    expected = values(rank0)
    net = make_net(seed=10 + R)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="deferred.")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="deferred.")  # twice: still one broadcast
    net(batch(0)[0][:1])  # the shapes become known: initialization, then the broadcast
    assert all(np.array_equal(a, b) for a, b in zip(values(net), expected)), "not rank 0's values"

with check("broadcast_parameters: initialized Gluon parameters (dict of Parameters) from the last rank"):
    net = make_net(seed=20 + R, in_units=True)
    last = make_net(seed=20 + N - 1, in_units=True)
    params = dict(net.collect_params().items())
    hvd.broadcast_parameters(params, root_rank=N - 1)
    assert all(np.array_equal(a, b) for a, b in zip(values(net), values(last))), "not the last rank's values"

with check("broadcast_parameters: bad arguments"):
    expect_error(ValueError, "invalid params of type", hvd.broadcast_parameters, list(make_net().collect_params()))
    expect_error(TypeError, "prefix must be a str", hvd.broadcast_parameters, {}, 0, 3)
    expect_error(ValueError, "'w' is a int, not an NDArray or a Parameter", hvd.broadcast_parameters, {"w": 1})

# ---------------------------------------------------------------------------------------- DistributedTrainer

with check("DistributedTrainer SGD with momentum matches one process on the full batch (float64)"):
    train_and_compare(hvd.DistributedTrainer, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, "sgd")

with check("DistributedTrainer Adam, gradient_predivide_factor=2, num_groups=2, prefix"):
    def make(params, optimizer, optimizer_params):
        return hvd.DistributedTrainer(params, optimizer, optimizer_params, gradient_predivide_factor=2.0,
                                      prefix="adam.", num_groups=2)

    trainer = train_and_compare(make, "adam", {"learning_rate": 0.01, "wd": 0.01}, "adam")
    assert trainer._scale == 2.0 / N and trainer._optimizer.rescale_grad == 2.0 / N / PER_RANK

with check("DistributedTrainer fp16 compression (float32 model) stays close to the full batch"):
    def make(params, optimizer, optimizer_params):
        return hvd.DistributedTrainer(params, optimizer, optimizer_params, compression=hvd.Compression.fp16)

    train_and_compare(make, "sgd", {"learning_rate": 0.1}, "fp16", dtype="float32", tolerance=2e-3)

with check("DistributedTrainer: a list of parameters in rank-dependent order, a frozen parameter, "
           "allreduce_grads() then update()"):
    def make(params, optimizer, optimizer_params):
        listed = list(params.values())
        return hvd.DistributedTrainer(listed if R == 0 else listed[::-1], optimizer, optimizer_params)

    train_and_compare(make, "sgd", {"learning_rate": 0.1, "momentum": 0.5}, "list", frozen=(1,), manual_reduce=True)

with check("DistributedTrainer unwraps a DistributedOptimizer with a warning"):
    def make(params, optimizer, optimizer_params):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = hvd.DistributedTrainer(params, hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1)))
        assert any("unwrapped it for you" in str(w.message) for w in caught), caught
        assert type(trainer._optimizer) is mx.optimizer.SGD
        return trainer

    train_and_compare(make, "sgd", {"learning_rate": 0.1}, "unwrap")

with check("DistributedTrainer argument errors, raised before anything is sent"):
    params = make_net(in_units=True).collect_params()
    expect_error(TypeError, "prefix must be a str or None", hvd.DistributedTrainer, params, "sgd", prefix=1)
    expect_error(ValueError, "gradient_predivide_factor must be > 0", hvd.DistributedTrainer, params, "sgd",
                 gradient_predivide_factor=0)
    expect_error(ValueError, "list or dict of Parameters", hvd.DistributedTrainer, [mx.nd.ones(2)], "sgd")
    two = gluon.nn.Dense(2, in_units=2)
    two.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = hvd.DistributedTrainer(two.collect_params(), "sgd")
    with autograd.record():
        loss = sum(two(mx.nd.ones((1, 2), ctx=c)).sum() for c in (mx.cpu(0), mx.cpu(1)))
    loss.backward()
    expect_error(ValueError, "lives on 2 contexts; rvod reduces one copy per rank", trainer.step, 1)

# ------------------------------------------------------------------------------- DistributedOptimizer (Module)


def mlp_symbol():
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name="fc1"), act_type="tanh")
    out = mx.sym.FullyConnected(hidden, num_hidden=3, name="fc2")
    return mx.sym.SoftmaxOutput(out, name="softmax", normalization="null")


def make_module(rows, optimizer, arg_params=None):
    module = mx.mod.Module(mlp_symbol(), data_names=["data"], label_names=["softmax_label"])
    module.bind(data_shapes=[("data", (rows, 64))], label_shapes=[("softmax_label", (rows,))])
    module.init_params(mx.init.Xavier(), arg_params=arg_params, allow_missing=arg_params is None, force_init=True)
    module.init_optimizer(kvstore=None, optimizer=optimizer)
    return module


def module_values(module):
    arg_params, _ = module.get_params()
    return [arg_params[k].asnumpy() for k in sorted(arg_params)]


for num_groups, factor in ((0, 1.0), (1, 4.0)):
    with check(f"DistributedOptimizer (Module API, num_groups={num_groups}, gradient_predivide_factor={factor}) "
               "matches one process on the full batch"):
        mx.random.seed(30 + R)
        inner = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / PER_RANK)
        optimizer = hvd.DistributedOptimizer(inner, gradient_predivide_factor=factor, num_groups=num_groups)
        assert inner.rescale_grad == factor / N / PER_RANK and optimizer.rescale_grad == inner.rescale_grad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Module notes that rescale_grad is not 1 / batch size
            module = make_module(PER_RANK, optimizer)
        arg_params, aux_params = module.get_params()
        hvd.broadcast_parameters(arg_params, root_rank=0, prefix=f"module.{num_groups}.")
        module.set_params(arg_params, aux_params)
        same_on_every_rank(module_values(module), f"module.{num_groups}.init")
        assert optimizer.idx2name and optimizer.idx2name is inner.idx2name, "Module's idx2name must reach the optimizer"
        reference = make_module(BATCH, mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / BATCH),
                                arg_params=arg_params)
        for step in range(STEPS):
            x, y = batch(step, "float32")
            x = x.reshape((BATCH, 64))
            module.forward(mx.io.DataBatch([x[SHARD]], [y[SHARD]]), is_train=True)
            module.backward()
            module.update()
            reference.forward(mx.io.DataBatch([x], [y]), is_train=True)
            reference.backward()
            reference.update()
            same_on_every_rank(module_values(module), f"module.{num_groups}.{step}")
            difference = max_difference(module_values(module), module_values(reference))
            assert difference < 1e-5, f"step {step} differs from the full batch by {difference}"

with check("DistributedOptimizer forwards attributes and the learning-rate methods to the wrapped optimizer"):
    inner = mx.optimizer.Adam(learning_rate=0.01)
    optimizer = hvd.DistributedOptimizer(inner)
    assert isinstance(optimizer, mx.optimizer.Optimizer) and optimizer.lr == 0.01
    optimizer.set_learning_rate(0.5)
    assert inner.lr == 0.5 and optimizer.learning_rate == 0.5
    optimizer.wd = 0.25
    assert inner.wd == 0.25 and "wd" not in vars(optimizer)
    optimizer.set_lr_mult({"w": 2.0})
    assert inner.lr_mult == {"w": 2.0}
    weight, grad = mx.nd.ones((3,)), mx.nd.full((3,), float(R + 1))
    state = optimizer.create_state_multi_precision(0, weight)
    optimizer.update_multi_precision(0, weight, grad, state)
    assert np.allclose(grad.asnumpy(), N * (N + 1) / 2), grad  # summed in place; the average is in rescale_grad

with check("DistributedOptimizer argument errors"):
    expect_error(TypeError, "wraps an mx.optimizer.Optimizer", hvd.DistributedOptimizer, "sgd")
    expect_error(ValueError, "already a DistributedOptimizer", hvd.DistributedOptimizer,
                 hvd.DistributedOptimizer(mx.optimizer.SGD()))
    expect_error(ValueError, "gradient_predivide_factor must be > 0", hvd.DistributedOptimizer, mx.optimizer.SGD(),
                 gradient_predivide_factor=-1)

hvd.shutdown()
finish(R)
