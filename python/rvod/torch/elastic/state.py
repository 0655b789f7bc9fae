"""``TorchState``: a model, an optimizer, samplers and named objects, committed and restored together.

A sharded ``DistributedOptimizer`` is committed as this rank's slice plus a buddy copy of another rank's,
handed to ranks that stay before a planned world change, and resharded for the new world at ``sync()`` or,
when hosts were only removed, ``relayout()`` (``_ShardedOptimizerHandler``)."""

import copy

import torch

from rvod.common.elastic import ObjectState
from rvod.common.sharded_commits import ShardCommits
from rvod.torch import parameter_gathers
from rvod.torch.elastic.sampler import ElasticSampler
from rvod.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from rvod.torch.mpi_ops import rank


class _Handler:
    def __init__(self, value):
        self.value = value
        self.save()

    def set_value(self, value):
        self.value = value
        self.save()

    def reset(self):
        pass


class _StateDictHandler(_Handler):
    """A module or optimizer: committed as a copy of its ``state_dict``."""

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)


class _ModelHandler(_StateDictHandler):
    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_StateDictHandler):
    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)

    def reset(self):
        forget = getattr(self.value, "_forget_reductions", None)  # a DistributedOptimizer
        if forget is not None:
            forget()


class _ShardedOptimizerHandler(_OptimizerHandler):
    """A ``DistributedOptimizer(sharded=True)``: a commit keeps this rank's slice of the state and a copy of
    the previous rank's (its buddy copy, received at the commit), both in memory (``ShardCommits``).
    ``hand_over(leaving)`` (hosts changed, the old world still runs) commits the live slices so that ranks
    that stay hold them all. ``sync()`` (after a reset, in the new world) lays the optimizer out for the new
    size and gives every rank its slice of the state rank 0 committed, gathered from whoever holds each old
    slice, then commits it (buddy copies in the new world); it raises, naming them, when a slice and its buddy
    copy were both lost."""

    def __init__(self, value):
        self.value = value
        self._commits = self._tracking(value)

    @staticmethod
    def _tracking(optimizer):
        return ShardCommits(lambda: optimizer._layout.describe(), lambda: copy.deepcopy(optimizer._shard_states()))

    def set_value(self, value):
        self.value = value
        self._commits = self._tracking(value)

    def save(self):
        self._commits.save()

    def restore(self):
        """Nothing here: the world changes next, and ``sync()`` brings the committed slices back."""

    def hand_over(self, leaving):
        self._commits.hand_over(leaving)

    def sync(self):
        optimizer = self.value
        options = broadcast_object([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                                   0, name="elastic.sharded.options")
        slices = self._commits.gather()
        optimizer._shard()
        optimizer._load_whole(optimizer._consolidated(slices))
        for group, group_options in zip(optimizer.param_groups, options):
            group.update(group_options)
        self._commits.restart(slices[0][0]["commit"])


class _SamplerHandler(_Handler):
    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name="elastic.sampler"))

    def reset(self):
        self.value.reset()


def _handler_for(value):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _ShardedOptimizerHandler(value) if hasattr(value, "_layout") else _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training loop: ``model``, ``optimizer`` and keyword arguments. Modules, optimizers
    and ``ElasticSampler``s among them are saved with their ``state_dict`` and synchronised by broadcast;
    anything else is a Python object deep-copied on commit and broadcast from rank 0."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, objects = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            elif value is not None or name not in ("model", "optimizer"):
                objects[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **objects)

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)

    def save(self):
        parameter_gathers.wait_all()  # a sharded optimizer's last step: commit the gathered parameters
        # Sharded optimizers first: their buddy exchange may fail (a rank died), leaving the last commit whole.
        handlers = sorted(self._handlers.values(), key=lambda h: not isinstance(h, _ShardedOptimizerHandler))
        for handler in handlers:
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            abandon = getattr(handler.value, "_abandon_gather", None)  # before a model loads its commit
            if abandon is not None:
                abandon()
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def _sharded_handlers(self):
        return [h for h in self._handlers.values() if isinstance(h, _ShardedOptimizerHandler)]

    def relayout(self):
        """Hosts were only removed: the sharded optimizers take their slices of the new world."""
        for handler in self._sharded_handlers():
            handler.sync()

    def hand_over(self, leaving):
        parameter_gathers.wait_all()  # the parameters of the last step, which the next world goes on from
        for handler in self._sharded_handlers():
            handler.hand_over(leaving)

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
