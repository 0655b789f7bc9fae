"""Elastic training for PyTorch (``hvd.elastic`` in ``import rvod.torch as hvd``), as ``horovod.torch.elastic``.

The state, the run loop and the driver protocol live in ``rvod.common.elastic``; this module adds what is
PyTorch's: ``TorchState`` (model, optimizer, ``ElasticSampler`` and any named objects) and the sampler.
"""

import functools

from rvod.common.elastic import ObjectState, State, reset_engine, run_fn
from rvod.torch.elastic.sampler import ElasticSampler
from rvod.torch.elastic.state import TorchState
from rvod.torch.mpi_ops import init, shutdown

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


def run(func):
    """Decorator for ``func(state, ...)``: runs it, and after a failure or a change of hosts, resets the job
    to its new world and runs it again from the state's last commit (see rvod.common.elastic.run_fn)."""
    return run_fn(func, functools.partial(reset_engine, shutdown, init))
