"""DistributedOptimizer (``mx.optimizer`` / Module API) and DistributedTrainer (Gluon).

Both sum gradients across the ranks of a process set and leave the averaging to the optimizer, as Horovod
does on CPU: the optimizer's ``rescale_grad`` (the Trainer's ``_scale``) is multiplied by
``gradient_predivide_factor / size``, and each gradient is scaled by ``1 / gradient_predivide_factor``
before the sum. The gradients of one call are all submitted before any is waited for, so the engine fuses
them; each is named after its index (``prefix`` + index in the Trainer), so the response cache serves
every later step. In a job (or process set) of one rank nothing is reduced and nothing is rescaled.
"""

import warnings

import mxnet as mx

from rvod.common import ops as _ops
from rvod.common.gradients import Reduction, check_num_groups, refuse_rewrapping, split_evenly
from rvod.common.process_sets import global_process_set, registered_id
from rvod.common.reduce_ops import Average, Sum
from rvod.mxnet.adapter import adapter_for
from rvod.mxnet.compression import Compression


def _averaging(gradient_predivide_factor, num_groups, process_set):
    """The checked options, as a ``Reduction`` (Average: its postscale factor goes into ``rescale_grad``,
    divided by the set's size), and the factor ``rescale_grad`` is multiplied by (1 on one rank)."""
    reduction = Reduction(Average, gradient_predivide_factor, groups=check_num_groups(num_groups))
    registered_id(process_set)
    set_size = process_set.size()
    return reduction, (reduction.postscale_factor / set_size if set_size > 1 else 1.0)


def _sum_in_place(named_grads, reduction, process_set, compression=Compression.none):
    """Sum each (name, gradient) across ``process_set`` into the gradient, scaled by the reduction's
    prescale factor first; with ``groups`` n the gradients go in n fused groups named ``first:last``."""
    compressed = [(name, grad, *compression.compress(grad)) for name, grad in named_grads]
    prescale = reduction.prescale_factor
    if reduction.groups is not None:
        handles = []
        for group in split_evenly(compressed, reduction.groups):
            tensors = [entry[2] for entry in group]
            handles.append(_ops.grouped_allreduce_async(
                adapter_for(tensors), tensors, name=f"{group[0][0]}:{group[-1][0]}", op=Sum,
                prescale_factor=prescale, process_set=process_set, in_place=True))
    else:
        handles = [_ops.allreduce_async(adapter_for(wire), wire, name=name, op=Sum, prescale_factor=prescale,
                                        process_set=process_set, in_place=True)
                   for name, _, wire, _ in compressed]
    for handle in handles:
        _ops.synchronize(handle)
    for _, grad, wire, context in compressed:
        if wire is not grad:
            grad[:] = compression.decompress(wire, context)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer`` so that ``update`` first sums the gradients across ranks.

    For the Module API: ``mod.init_optimizer(kvstore=None, optimizer=hvd.DistributedOptimizer(opt))``.
    Attributes are read from and written to the wrapped optimizer (``opt.lr``, ``opt.rescale_grad``,
    what Module sets), so it behaves as the optimizer it wraps. Its ``rescale_grad`` is multiplied by
    ``gradient_predivide_factor / size`` here, once: Module never changes it afterwards.
    """

    _OWN = frozenset(("_optimizer", "_reduction", "_process_set", "_rescale"))

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0, process_set=global_process_set):
        refuse_rewrapping(optimizer, DistributedOptimizer)
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, got {type(optimizer).__name__}")
        reduction, rescale = _averaging(gradient_predivide_factor, num_groups, process_set)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_reduction", reduction)
        object.__setattr__(self, "_process_set", process_set)
        object.__setattr__(self, "_rescale", rescale)
        optimizer.rescale_grad *= self._rescale

    def __getattr__(self, item):
        if item in DistributedOptimizer._OWN:  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, name, value):
        if name in DistributedOptimizer._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._optimizer, name, value)

    def _sum_gradients(self, index, grad):
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        if isinstance(index, (list, tuple)):
            named = [(str(i), g) for i, g in zip(index, grad)]
        else:
            named = [(str(index), grad)]
        _sum_in_place(named, self._reduction, self._process_set)

    def update(self, index, weight, grad, state):
        self._sum_gradients(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._sum_gradients(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)

    def _set_current_context(self, device_id):
        self._optimizer._set_current_context(device_id)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step`` (and ``allreduce_grads``) sums gradients across ranks with rvod.

    Arguments are Horovod's: ``compression`` (``Compression.none`` or ``.fp16``) applies to the gradients
    on the wire; ``gradient_predivide_factor`` splits the averaging into ``1 / f`` before the sum and
    ``f / size`` after; ``prefix`` names this trainer's gradients (give each trainer of a script its own);
    ``num_groups > 0`` reduces the gradients in that many fused groups. The gradients of parameters with
    ``grad_req='null'`` are not reduced. A list of parameters is sorted by name, so that every rank
    reduces them under the same names whatever order it listed them in. A ``DistributedOptimizer`` passed
    as the optimizer is unwrapped (with a warning), its averaging factor taken back out of ``rescale_grad``.
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0, process_set=global_process_set):
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer does not take DistributedOptimizer as its optimizer. We have "
                          "unwrapped it for you.", stacklevel=2)
            optimizer.rescale_grad /= optimizer._rescale  # this trainer applies its own averaging factor
            optimizer = optimizer._optimizer
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str or None, got {type(prefix).__name__}")
        reduction, rescale = _averaging(gradient_predivide_factor, num_groups, process_set)
        if isinstance(params, (list, tuple)):
            if not all(isinstance(p, mx.gluon.Parameter) for p in params):
                raise ValueError(f"First argument must be a list or dict of Parameters, got {type(params)}")
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._reduction = reduction
        self._prefix = prefix or ""
        self._process_set = process_set
        # step() sets the optimizer's rescale_grad to _scale / batch_size: the averaging happens there.
        self._scale *= rescale

    def _allreduce_grads(self):
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        named = []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            if len(grads) != 1:
                raise ValueError(f"DistributedTrainer: parameter {param.name} lives on {len(grads)} contexts; rvod "
                                 "reduces one copy per rank: start one rank per device instead")
            named.append((self._prefix + str(i), grads[0]))
        _sum_in_place(named, self._reduction, self._process_set, self._compression)
