"""DistributedOptimizer: an optax ``GradientTransformation`` that averages the updates (gradients) across
ranks before the wrapped transformation sees them.

The reduction is ``rvod.common.gradients``': one grouped allreduce of every leaf (or ``groups`` of them),
fused by the engine, with ``op`` and ``gradient_predivide_factor`` checked and applied as in every shim.
It works eagerly and inside ``jax.jit`` (the usual place for a training step). A rank outside
``process_set``, or a set of one rank, exchanges nothing. Horovod's ``backward_passes_per_step`` is
``optax.MultiSteps`` here: wrap the DistributedOptimizer in it, so gradients are exchanged once per step.
"""

import jax

from rvod.common import gradients as _gradients
from rvod.common.process_sets import global_process_set
from rvod.common.reduce_ops import Average
from rvod.jax.mpi_ops import grouped_allreduce


class _GradientReducer(_gradients.GradientReducer):
    def grouped_allreduce(self, grads, compression, op, prescale_factor, postscale_factor, process_set):
        return grouped_allreduce(grads, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 process_set=process_set)


def DistributedOptimizer(optimizer, op=Average, gradient_predivide_factor=1.0, groups=None,
                         process_set=global_process_set):
    """Wrap the optax transformation ``optimizer`` so that ``update`` first reduces the updates across the
    ranks of ``process_set`` (``op``: Average or Sum; ``groups``: the number of grouped allreduces to
    split the leaves into, by default one). Returns an ``optax.GradientTransformationExtraArgs``."""
    import optax

    if groups is not None and not isinstance(groups, int):
        raise ValueError(f"groups of rvod.jax's DistributedOptimizer is a number of groups, got {groups!r}")
    reducer = _GradientReducer(None, False, op, gradient_predivide_factor, 0, groups, process_set)
    inner = optax.with_extra_args_support(optimizer)

    def update_fn(updates, state, params=None, **extra_args):
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        reduced = jax.tree_util.tree_unflatten(treedef, reducer(leaves))
        return inner.update(reduced, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
