"""Elastic training for PyTorch (``hvd.elastic`` in ``import rvod.torch as hvd``), as ``horovod.torch.elastic``.

The state, the run loop and the driver protocol live in ``rvod.common.elastic``; this module adds what is
PyTorch's: ``TorchState`` (model, optimizer, ``ElasticSampler`` and any named objects) and the sampler.
"""

import functools

from rvod.common.elastic import ObjectState as _ObjectState, State, reset_engine, run_fn
from rvod.torch.elastic.sampler import ElasticSampler
from rvod.torch.elastic.state import TorchState
from rvod.torch.functions import broadcast_object
from rvod.torch.mpi_ops import init, rank, shutdown

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


class ObjectState(_ObjectState):
    """Plain Python objects (keyword arguments) committed, restored and synchronised from rank 0."""

    def __init__(self, **kwargs):
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)


def run(func):
    """Decorator for ``func(state, ...)``: runs it, and after a failure or a change of hosts, resets the job
    to its new world and runs it again from the state's last commit (see rvod.common.elastic.run_fn)."""
    return run_fn(func, functools.partial(reset_engine, shutdown, init))
