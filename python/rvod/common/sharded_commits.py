"""Elastic commits of a sharded optimizer's state, framework-neutral: ``ShardCommits`` keeps, in memory, this
rank's slice of the last commit and a buddy copy of another rank's, and gives back in a new world the
slices of rank 0's last commit (``rvod.common.sharding.gather_held``). The elastic states of rvod.torch and of
Keras (``rvod.common.elastic_variables``) hold one per sharded optimizer; each gives the layout and a copy of
its shard states. Slices travel pickled, as NumPy bytes, so any framework's tensors that pickle do.
"""

import cloudpickle
import numpy as np

from rvod.common import ops
from rvod.common.numpy_adapter import NumpyAdapter
from rvod.common.objects import allgather_object
from rvod.common.sharding import buddy_of, gather_held


class ShardCommits:
    """``describe()`` gives the optimizer's layout description (``ShardLayout.describe()``), ``copy_states()``
    a copy of its shard states. A commit (``save()``) keeps this rank's slice and swaps buddy copies with its
    neighbours (collective); ``gather()`` (collective, in the new world) returns the slices of the last
    commit, in old-rank order, as ``(layout description, shard states)``; ``restart()`` forgets the commits
    once the optimizer holds them laid out for the new world."""

    def __init__(self, describe, copy_states):
        self._describe, self._copy_states = describe, copy_states
        self._commits = 0
        self.held = self._own()  # at construction ranks are not in step: no exchange

    def _own(self, commit=0):
        description = self._describe()
        return {description["rank"]: ({**description, "commit": commit}, self._copy_states())}

    def save(self):
        """Commit (collective). When the exchange fails (a rank died) the last commit is kept whole."""
        held = self._own(self._commits + 1)
        description = self._describe()
        rank, size = description["rank"], description["size"]
        if size > 1:
            held[(rank - 1) % size] = _buddy_exchange(held[rank], rank, size)
        self._commits += 1
        self.held = held

    def gather(self):
        return gather_held(allgather_object(self.held, name="elastic.sharded.held"))

    def restart(self):
        self._commits = 0
        self.held = self._own()


def _buddy_exchange(own, rank, size):
    """Send ``own`` to this rank's buddy; return what the rank whose buddy this one is sent."""
    payload = np.frombuffer(cloudpickle.dumps(own), dtype=np.uint8)
    splits = np.zeros(size, dtype=np.int32)
    splits[buddy_of(rank, size)] = payload.size
    received, _ = ops.wait_for(ops.alltoall_async, NumpyAdapter(), payload, splits, "elastic.sharded.buddy")
    return cloudpickle.loads(np.asarray(received).tobytes())
