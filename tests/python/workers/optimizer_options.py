"""Hands every bad option to one framework's distributed optimizers (and tape/trainer), in a job of one rank
started with plain ``python``, and prints one JSON line: {"<entry point>|<case>": "<error type>: <message>"}
(or "accepted"). test_optimizer_options.py compares the lines of torch, tensorflow and mxnet.

Usage: python optimizer_options.py torch|tensorflow|mxnet
"""

import json
import sys

FRAMEWORK = sys.argv[1]


def outcome(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"
    return "accepted"


def common_cases(hvd, make, wrapped, variable):
    """The cases every optimizer taking Horovod's gradient options refuses; ``make(**options)`` builds one."""
    return {
        "op=Sum, gradient_predivide_factor=2": lambda: make(op=hvd.Sum, gradient_predivide_factor=2.0),
        "op=Min": lambda: make(op=hvd.Min),
        "groups=-1": lambda: make(groups=-1),
        "groups=[[w], [w]]": lambda: make(groups=[[variable], [variable]]),
        **factor_cases(make),
        "already wrapped": lambda: make(wrapped=wrapped),
        "unregistered process set": lambda: make(process_set=hvd.ProcessSet([0])),
    }


def factor_cases(make):
    return {
        "gradient_predivide_factor=0": lambda: make(gradient_predivide_factor=0),
        "gradient_predivide_factor=-1.0": lambda: make(gradient_predivide_factor=-1.0),
        "gradient_predivide_factor=inf": lambda: make(gradient_predivide_factor=float("inf")),
        "num_groups=-1": lambda: make(num_groups=-1),
    }


def torch_cases():
    import torch

    import rvod.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 2)

    def make(wrapped=None, **options):
        optimizer = wrapped or torch.optim.SGD(model.parameters(), lr=0.1)
        return hvd.DistributedOptimizer(optimizer, named_parameters=[("w", model.weight), ("b", model.bias)],
                                        **options)

    cases = common_cases(hvd, make, make(), model.weight)
    cases["backward_passes_per_step=0"] = lambda: make(backward_passes_per_step=0)
    cases["backward_passes_per_step=1.5"] = lambda: make(backward_passes_per_step=1.5)
    cases["groups=[[1]]"] = lambda: make(groups=[[1]])
    return {"torch.DistributedOptimizer": cases}


def tensorflow_cases():
    import keras
    import tensorflow as tf

    import rvod.tensorflow as hvd

    hvd.init()
    variable = tf.Variable([1.0], name="w")
    keras_variable = keras.Variable([1.0], name="w")

    def tape(wrapped=None, **options):
        return hvd.DistributedGradientTape(wrapped or tf.GradientTape(), **options)

    def keras_optimizer(wrapped=None, **options):
        return hvd.DistributedOptimizer(wrapped or keras.optimizers.SGD(0.1), **options)

    def legacy_optimizer(wrapped=None, **options):
        return hvd.DistributedOptimizer(wrapped or tf.compat.v1.train.GradientDescentOptimizer(0.1), **options)

    tape_cases = common_cases(hvd, tape, tape(), variable)
    keras_cases = common_cases(hvd, keras_optimizer, keras_optimizer(), keras_variable)
    keras_cases["backward_passes_per_step=0"] = lambda: keras_optimizer(backward_passes_per_step=0)
    legacy_cases = common_cases(hvd, legacy_optimizer, None, variable)
    del legacy_cases["already wrapped"]  # a wrapped tf.compat.v1 optimizer is a tf.compat.v1 optimizer again
    legacy_cases["backward_passes_per_step=0"] = lambda: legacy_optimizer(backward_passes_per_step=0)
    return {"tensorflow.DistributedGradientTape": tape_cases, "tensorflow.DistributedOptimizer(keras)": keras_cases,
            "tensorflow.DistributedOptimizer(tf.compat.v1)": legacy_cases}


def mxnet_cases():
    import mxnet as mx

    import rvod.mxnet as hvd

    hvd.init()
    dense = mx.gluon.nn.Dense(1, in_units=1)
    dense.initialize()

    def optimizer(wrapped=None, **options):
        return hvd.DistributedOptimizer(wrapped or mx.optimizer.SGD(), **options)

    def trainer(**options):
        return hvd.DistributedTrainer(dense.collect_params(), "sgd", **options)

    optimizer_cases = factor_cases(optimizer)
    optimizer_cases["already wrapped"] = lambda: optimizer(wrapped=optimizer())
    optimizer_cases["unregistered process set"] = lambda: optimizer(process_set=hvd.ProcessSet([0]))
    trainer_cases = factor_cases(trainer)
    trainer_cases["unregistered process set"] = lambda: trainer(process_set=hvd.ProcessSet([0]))
    return {"mxnet.DistributedOptimizer": optimizer_cases, "mxnet.DistributedTrainer": trainer_cases}


entries = {"torch": torch_cases, "tensorflow": tensorflow_cases, "mxnet": mxnet_cases}[FRAMEWORK]()
print(json.dumps({f"{entry}|{case}": outcome(call) for entry, cases in entries.items() for case, call in cases.items()}))
