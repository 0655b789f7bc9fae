"""Making every rank start from the same state: parameter pytrees, optimizer states and arbitrary objects.

jax.Arrays are immutable, so ``broadcast_parameters`` returns a new pytree rather than writing into the
old one. Eagerly its broadcasts all start at once (the engine fuses them) and are waited for together;
inside ``jax.jit`` they run one after the other, as every traced op does. Each leaf's broadcast is named by
its path in the pytree, so every rank matches the same leaves whatever order it builds its dicts in.
"""

import jax

from rvod.common import ops as _ops
from rvod.common.objects import allgather_object, broadcast_object
from rvod.common.process_sets import global_process_set
from rvod.jax.mpi_ops import _adapter, _inputs, _staged, broadcast

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params, root_rank=0, process_set=global_process_set, prefix="parameter"):
    """``root_rank``'s values of the pytree ``params`` (e.g. a model's parameters), on every rank of
    ``process_set``: a new pytree of the same structure. Leaves are named ``<prefix><path>``."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = _inputs([leaf for _, leaf in paths_and_leaves])
    names = [f"{prefix}{jax.tree_util.keystr(path)}" for path, _ in paths_and_leaves]
    if _staged(leaves):
        results = [broadcast(leaf, root_rank, name, process_set) for leaf, name in zip(leaves, names)]
    else:
        handles = [_ops.broadcast_async(_adapter, leaf, int(root_rank), name, process_set)
                   for leaf, name in zip(leaves, names)]
        results = [_ops.synchronize(handle) for handle in handles]
    return jax.tree_util.tree_unflatten(treedef, results)


def broadcast_optimizer_state(opt_state, root_rank=0, process_set=global_process_set):
    """``root_rank``'s optimizer state (an optax state: any pytree of arrays) on every rank."""
    return broadcast_parameters(opt_state, root_rank, process_set, prefix="optimizer_state")
