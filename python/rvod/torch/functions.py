"""Making every rank start from the same state: parameters, optimizer state and arbitrary objects."""

import torch

from rvod.common.objects import allgather_object, broadcast_object
from rvod.torch import parameter_gathers
from rvod.torch.mpi_ops import broadcast_async_, rank, synchronize

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


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
    parameter_gathers.wait_all()  # a sharded optimizer's allgather would overwrite them later
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"invalid params: {name or 'an entry'} is a {type(tensor).__name__}, not a tensor")
        handles.append(broadcast_async_(tensor, root_rank, None if name is None else f"parameter.{name}"))
    for handle in handles:
        synchronize(handle)


def _initialize_state(optimizer):
    """Give a fresh optimizer its state by one step on zero gradients, leaving the parameters as they were.
    As in Horovod, a trainable parameter that had no gradient keeps the zero gradient (sparse for
    ``SparseAdam``), so ``p.grad`` can be used afterwards; a gradient already computed is kept as it was."""
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
    # A step on zero gradients still moves parameters under weight decay: put their values back.
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            if grad is not None:
                p.grad = grad


def _layout(optimizer):
    """The root's description of an optimizer: each group's hyper-parameters, and each parameter's state
    entries as ("tensor", shape, dtype) or ("value", value), keyed by (group index, parameter index)."""
    state = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p in optimizer.state:
                state[(g, i)] = {key: ("tensor", tuple(value.shape), value.dtype) if torch.is_tensor(value)
                                 else ("value", value) for key, value in optimizer.state[p].items()}
    options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return options, state


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Give every rank ``root_rank``'s optimizer state.

    The root's hyper-parameters (types kept: Adam's ``betas`` stay a tuple), non-tensor state and the
    layout of its state tensors travel as one object; then every state tensor is broadcast in place. Ranks
    whose state is laid out differently (another ``amsgrad``, a missing momentum buffer) take the root's
    layout. A fresh optimizer (on any rank) first gets its state from one step on zero gradients, which
    leaves a zero gradient on every trainable parameter that had none, as Horovod does.
    ``model`` is accepted for Horovod compatibility; state is matched by position in the parameter
    groups, so it is not needed. A sharded optimizer (each rank owning a slice of the state) takes the
    root's group options, and its slices of a consolidated state dict loaded on the root alone.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    sharded = getattr(optimizer, "_broadcast_state", None)  # DistributedOptimizer(sharded=True): its own way
    if sharded is not None:
        sharded(root_rank)
        return
    if not optimizer.state:
        _initialize_state(optimizer)
    layout = _layout(optimizer) if rank() == root_rank else None
    options, layout = broadcast_object(layout, root_rank, name="optimizer.layout")

    for group, group_options in zip(optimizer.param_groups, options):
        group.update(group_options)
    params = {(g, i): p for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}
    for position, p in params.items():
        if position not in layout:
            optimizer.state.pop(p, None)
    tensors = {}
    for (g, i), entries in layout.items():
        p = params[(g, i)]
        state = optimizer.state[p]
        for key in [k for k in state if k not in entries]:
            del state[key]
        for key, entry in entries.items():
            if entry[0] == "value":
                state[key] = entry[1]
                continue
            current = state.get(key)
            shape, dtype = entry[1], entry[2]
            if not (torch.is_tensor(current) and tuple(current.shape) == shape and current.dtype == dtype):
                state[key] = current = torch.zeros(shape, dtype=dtype)
            tensors[f"optimizer.{g}.{i}.{key}"] = current
    broadcast_parameters(tensors, root_rank)
