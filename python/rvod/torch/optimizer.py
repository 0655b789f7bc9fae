"""DistributedOptimizer: averages gradients across ranks while backward is still running.

Each parameter gets a post-accumulate-grad hook; as soon as its gradient is complete (on the last of
``backward_passes_per_step`` backward passes) the hook starts an in-place allreduce of it, named after the
parameter so that the engine's response cache serves every later step. ``step()`` waits for those
allreduces, reduces whatever no hook reduced (parameters that got no gradient on this rank are reduced as
zeros, so ranks whose graphs differ never wait on each other), then runs the wrapped optimizer's step.

Sparse gradients (``nn.Embedding(sparse=True)``) stay sparse, as optimizers such as ``SparseAdam`` require:
their indices and values are allgathered, as Horovod does. With ``sparse_as_dense=True`` they are reduced
as dense tensors instead and handed back to the optimizer sparse.

The object returned is an instance of a subclass of the wrapped optimizer's class with the same name,
sharing its parameter groups and state, so ``isinstance`` checks, ``state_dict()`` and learning-rate
schedulers keep working. With ``op=Adasum`` on more than one rank the subclass mixes in
``rvod.torch.adasum_optimizer`` instead, which combines parameter updates rather than gradients; with
``sharded=True`` it mixes in ``rvod.torch.sharded_optimizer`` too, which shards the optimizer state.
"""

import contextlib
import warnings

import torch

from rvod.common import ops as _ops
from rvod.common.basics import size
from rvod.common.compression import engine_code
from rvod.common.gradients import (Reduction, Variables, check_backward_passes_per_step, refuse_rewrapping,
                                   split_evenly)
from rvod.common.process_sets import global_process_set, registered_id
from rvod.common.reduce_ops import Adasum, Average
from rvod.torch.adasum_optimizer import _DistributedAdasumOptimizer
from rvod.torch.compression import Compression
from rvod.torch.functions import broadcast_object
from rvod.torch.mpi_ops import _adapter, sparse_allreduce_async, synchronize
from rvod.torch.sharded_optimizer import _ShardedOptimizer, refuse_unshardable

_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "The gradients were already reduced and are used as they are; wrap step() in "
    "`with optimizer.skip_synchronize():` when you call optimizer.synchronize() yourself."
)


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see the module docstring."""

    def _setup(self, parameter_names, compression, backward_passes_per_step, reduction, sparse_as_dense,
               process_set):
        """``reduction``: the checked ``op``, scale factors and ``groups`` (lists of parameters)."""
        self._compression = compression
        self._op = reduction.op
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self._sparse_dims = {}  # parameter -> sparse_dim of its last sparse gradient
        self._scale = (reduction.prescale_factor, reduction.postscale_factor)
        self._parameter_names = parameter_names
        self._requires_update = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._group_of = self._form_groups(reduction.groups)
        self._group_ready = {}
        self._pending = {}
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._hook_handles = []
        if process_set.included():
            self._hook_handles = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                                  for p in self._requires_update]

    # ---------------------------------------------------------------------------------------------- set-up

    def _form_groups(self, groups):
        """parameter -> the tuple of parameters reduced together with it (absent: reduced on its own), from
        the checked ``groups`` of a ``Reduction``: None, a count, or lists of parameters."""
        if groups is None:
            return {}
        if isinstance(groups, int):
            # Every rank must form the same groups: use the parameter order of the set's first rank.
            order = broadcast_object([self._parameter_names[p] for p in self._requires_update],
                                     root_rank=self._process_set.ranks[0], name="DistributedOptimizer.groups",
                                     process_set=self._process_set)
            position = {name: i for i, name in enumerate(order)}
            missing = [self._parameter_names[p] for p in self._requires_update
                       if self._parameter_names[p] not in position]
            if missing:
                raise ValueError(f"parameters {missing} do not exist on rank {self._process_set.ranks[0]}; "
                                 "groups=int needs the same model on every rank")
            ordered = sorted(self._requires_update, key=lambda p: position[self._parameter_names[p]])
            chunks = split_evenly(ordered, groups)
        else:
            trained = set(self._requires_update)
            chunks = [tuple(p for p in g if p in trained) for g in groups]
        return {p: chunk for chunk in chunks for p in chunk}

    # ------------------------------------------------------------------------------------- reduce gradients

    def _gradient_ready(self, p):
        """Post-accumulate-grad hook: start reducing ``p``'s gradient (or its group) on the last pass."""
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        group = self._group_of.get(p)
        if group is None:
            self._start(p)
            return
        ready = self._group_ready.setdefault(group, set())
        ready.add(p)
        if len(ready) == len(group):
            self._start(group)

    def _gradient(self, p):
        """``p.grad``, created as zeros when this rank computed none: sparse zeros for a parameter whose
        gradients were sparse before (so every rank reduces it the same way), dense zeros otherwise."""
        if p.grad is not None:
            if p.grad.is_sparse:
                self._sparse_dims[p] = p.grad.sparse_dim()
            return p.grad
        sparse_dim = self._sparse_dims.get(p)
        if sparse_dim is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad = torch.sparse_coo_tensor(torch.empty((sparse_dim, 0), dtype=torch.int64, device=p.device),
                                             p.new_empty((0, *p.shape[sparse_dim:])), p.shape,
                                             check_invariants=True)
        return p.grad

    def _start(self, key):
        """Start reducing the gradient of a parameter, or of a group (a tuple of parameters), and remember
        how to finish: wait, then write the result into the gradients."""
        start = self._start_group if isinstance(key, tuple) else self._start_parameter
        self._pending[key] = start(key)

    def _reduced_sparse(self, p, grad):
        """A sparse gradient stays sparse: its indices and values are allgathered (duplicate indices add up
        when the optimizer coalesces it)."""
        wait = sparse_allreduce_async(grad.coalesce(), f"sparse.{self._parameter_names[p]}", self._op,
                                      self._process_set)

        def finish():
            p.grad = wait()

        return finish

    def _start_parameter(self, p):
        grad = self._gradient(p)
        if grad.is_sparse and not self._sparse_as_dense:
            return self._reduced_sparse(p, grad)
        dense = grad.to_dense() if grad.is_sparse else grad
        compressed, context = self._compression.compress(dense)
        handle = _ops.allreduce_async(_adapter, compressed, None, self._parameter_names[p], self._op, *self._scale,
                                      self._process_set, True, engine_code(self._compression, [compressed]))

        def finish():
            synchronize(handle)
            self._write_back(p, grad, compressed, context)

        return finish

    def _start_group(self, group):
        """Dense gradients of the group are reduced as one grouped allreduce; sparse ones (unless
        ``sparse_as_dense``) each by allgather."""
        finishes, members = [], []
        for p in group:
            grad = self._gradient(p)
            if grad.is_sparse and not self._sparse_as_dense:
                finishes.append(self._reduced_sparse(p, grad))
            else:
                members.append((p, grad, self._compression.compress(grad.to_dense() if grad.is_sparse else grad)))
        handle = None
        if members:
            tensors = [compressed for _, _, (compressed, _) in members]
            handle = _ops.grouped_allreduce_async(_adapter, tensors, None, self._parameter_names[group[0]],
                                                  self._op, *self._scale, self._process_set, True,
                                                  engine_code(self._compression, tensors))

        def finish():
            if handle is not None:
                synchronize(handle)
            for p, grad, (reduced, context) in members:
                self._write_back(p, grad, reduced, context)
            for finish_sparse in finishes:
                finish_sparse()

        return finish

    def _write_back(self, p, grad, reduced, context):
        """Put the reduced values into ``p.grad``; a sparse gradient reduced as dense (``sparse_as_dense``)
        goes back sparse, as the optimizer expects (SparseAdam refuses dense gradients)."""
        result = self._compression.decompress(reduced, context)
        if grad.is_sparse:
            p.grad = result.to_sparse(grad.sparse_dim())
        elif result is not grad:
            with torch.no_grad():
                grad.copy_(result)

    # ------------------------------------------------------------------------------------------ public API

    def set_backward_passes_per_step(self, passes):
        """Reduce gradients every ``passes`` backward passes (accumulating locally in between)."""
        passes = check_backward_passes_per_step(passes)
        self.backward_passes_per_step = passes
        self._delay = {p: passes for p in self._requires_update}

    def synchronize(self):
        """Finish reducing every gradient: wait for those in flight and reduce the ones no hook started."""
        if self._process_set.included():
            for p in self._requires_update:
                key = self._group_of.get(p, p)
                if key not in self._pending:
                    self._start(key)
            for finish in self._pending.values():
                finish()
        self._pending.clear()
        self._group_ready.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = True

    def _forget_reductions(self):
        """Elastic reset: the reductions in flight died with the old world; start the next step afresh."""
        self._pending.clear()
        self._group_ready.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized and not self._pending:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            else:
                self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def _local_step(self, closure=None):
        """The wrapped optimizer's step alone, without reducing anything."""
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super().zero_grad(*args, **kwargs)


def _parameter_names(param_groups, named_parameters):
    """parameter -> the name its allreduce goes by: from ``named_parameters`` (each parameter of the
    optimizer named once), or by position in the optimizer's groups."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(param_groups)
                for i, p in enumerate(group["params"])}
    named_parameters = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    seen, duplicates = set(), set()
    for name, _ in named_parameters:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(sorted(duplicates)))
    names = {p: name for name, p in named_parameters}
    unnamed = [id(p) for group in param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: " + ", ".join(str(i) for i in unnamed))
    return names


def _parameters(names):
    """How ``Reduction`` checks torch's ``groups``: lists of ``torch.Tensor``, named as in ``names``."""
    return Variables("torch.Tensor", torch.Tensor, key=lambda p: p,
                     name=lambda p: names.get(p) or f"of shape {tuple(p.shape)} (not in the optimizer)")


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set, sharded=False):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op``) across the ranks of
    ``process_set``. See the module docstring; arguments are Horovod's, checked by ``rvod.common.gradients``,
    and ``sharded=True`` shards the optimizer state across the ranks (``rvod.torch.sharded_optimizer``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    refuse_rewrapping(optimizer, (_DistributedOptimizer, _DistributedAdasumOptimizer))
    names = _parameter_names(optimizer.param_groups, named_parameters)
    reduction = Reduction(op, gradient_predivide_factor, num_groups, groups, allow_adasum=True,
                          variables=_parameters(names))
    check_backward_passes_per_step(backward_passes_per_step)
    registered_id(process_set)
    if sharded:
        refuse_unshardable(optimizer, reduction.op == Adasum)
    adasum = reduction.op == Adasum and size() > 1
    mixins = ((_DistributedAdasumOptimizer,) if adasum else
              (_ShardedOptimizer, _DistributedOptimizer) if sharded else (_DistributedOptimizer,))
    cls = type(type(optimizer).__name__, (*mixins, type(optimizer)), {})
    distributed = cls.__new__(cls)
    # Share the wrapped optimizer's groups, state and hooks; instance-level wrappers of methods (an LR
    # scheduler wraps `step`) would bypass the reduction, so those stay behind.
    distributed.__dict__.update({k: v for k, v in vars(optimizer).items() if not hasattr(cls, k)})
    if adasum:
        # Horovod's Adasum optimizer combines parameter updates; groups and sparse_as_dense do not apply.
        distributed._setup(names, compression, backward_passes_per_step, process_set)
    else:
        distributed._setup(names, compression, backward_passes_per_step, reduction, sparse_as_dense, process_set)
    if sharded:
        whole = optimizer.state_dict() if optimizer.state else None
        distributed._shard()
        if whole is not None:  # state the wrapped optimizer already had: this rank keeps its shards of it
            distributed._load_whole(whole)
    return distributed
