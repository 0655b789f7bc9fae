"""Making every rank start from the same state: parameters, optimizer state and arbitrary objects."""

import torch

from rvod.common import objects as _objects
from rvod.common.process_sets import global_process_set
from rvod.torch.mpi_ops import allgather, broadcast, broadcast_async_, rank, synchronize


def broadcast_parameters(params, root_rank):
    """Overwrite tensors in place with ``root_rank``'s values.

    ``params`` is a dict such as ``model.state_dict()`` (broadcast in key order) or an iterable of tensors
    or ``(name, tensor)`` pairs such as ``model.named_parameters()``. The broadcasts are named by key, all
    start at once and are waited for together.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise ValueError(f"invalid params of type: {type(params)}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"invalid params: {name or 'an entry'} is a {type(tensor).__name__}, not a tensor")
        handles.append(broadcast_async_(tensor, root_rank, None if name is None else f"parameter.{name}"))
    for handle in handles:
        synchronize(handle)


def _initialize_state(optimizer):
    """Give a fresh optimizer its state by one step on zero gradients, leaving parameters and gradients as
    they were (a step on zero gradients still moves parameters under weight decay)."""
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                saved.append((p, p.detach().clone(), p.grad))
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    # A DistributedOptimizer would allreduce the zero gradients: take the wrapped optimizer's own step.
    local_step = getattr(optimizer, "_local_step", optimizer.step)
    local_step()
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            p.grad = grad


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Give every rank ``root_rank``'s optimizer state: the per-parameter state tensors (broadcast in
    place) and the hyper-parameters of each parameter group and any non-tensor state (as objects, so
    tuples such as Adam's ``betas``, booleans and ``None`` keep their types).

    A fresh optimizer first gets its state from one step on zero gradients. ``model`` is accepted for
    Horovod compatibility; state is matched by position in the parameter groups, so it is not needed.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _initialize_state(optimizer)

    tensors, others = [], {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optimizer.{g}.{i}.{key}", value))
                else:
                    others[(g, i, key)] = value
    options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    options, others = broadcast_object((options, others), root_rank, name="optimizer.options")
    broadcast_parameters(dict(tensors), root_rank)

    for group, group_options in zip(optimizer.param_groups, options):
        group.update(group_options)
    for (g, i, key), value in others.items():
        optimizer.state[optimizer.param_groups[g]["params"][i]][key] = value


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s picklable object on every rank (sent as a byte tensor)."""

    def broadcast_bytes(array, root, object_name):
        return broadcast(torch.tensor(array), root, object_name, process_set).numpy()

    return _objects.broadcast_object(broadcast_bytes, rank(), obj, root_rank, name)


def allgather_object(obj, name=None):
    """A list with every rank's picklable object, in rank order."""

    def allgather_bytes(array, object_name):
        return allgather(torch.tensor(array), object_name).numpy()

    return _objects.allgather_object(allgather_bytes, obj, name)
