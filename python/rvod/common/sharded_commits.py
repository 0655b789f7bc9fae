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
    neighbours (collective); ``hand_over(leaving)`` is a commit before a planned world change that also gives
    the slice of a rank that leaves to a rank that stays; ``gather()`` (collective, in the new world) returns
    the slices of the last commit, in old-rank order, as ``(layout description, shard states)``;
    ``restart(commit)`` commits the optimizer's slices once they are laid out for the new world (numbered
    after ``commit``, the one gathered), buddy copies included. Commit numbers only grow, so a rank that
    joined (holding only a fresh slice, commit 0) never passes for a holder of the last commit."""

    def __init__(self, describe, copy_states):
        self._describe, self._copy_states = describe, copy_states
        self._commits = 0
        self.held = self._own()  # at construction ranks are not in step: no exchange

    def _own(self, commit=0):
        description = self._describe()
        return {description["rank"]: ({**description, "commit": commit}, self._copy_states())}

    def save(self):
        """Commit (collective). When the exchange fails (a rank died) the last commit is kept whole."""
        self._commit(lambda rank, size: {buddy_of(rank, size)})

    def hand_over(self, leaving):
        """Commit (collective, in a world about to be replaced) so that the ranks that stay hold every slice:
        each goes to its buddy, and the slice of a rank that leaves (``leaving`` on that rank) also to the
        first rank after it, round the ring, that stays."""

        def destinations(rank, size):
            flags = allgather_object(bool(leaving), name="elastic.sharded.leaving")
            stays = [r for r in (*range(rank + 1, size), *range(rank)) if not flags[r]]
            return {buddy_of(rank, size), *stays[:1]} if leaving else {buddy_of(rank, size)}

        self._commit(destinations)

    def _commit(self, destinations):
        held = self._own(self._commits + 1)
        description = self._describe()
        rank, size = description["rank"], description["size"]
        if size > 1:
            held.update(_exchange({rank: held[rank]}, destinations(rank, size), size))
        self._commits += 1
        self.held = held

    def gather(self):
        return gather_held(allgather_object(self.held, name="elastic.sharded.held"))

    def restart(self, commit):
        self._commits = commit
        self.save()


def _exchange(own, destinations, size):
    """Send ``own`` (``{rank: slice}``) to every rank in ``destinations``; return what the others sent here,
    merged."""
    payload = cloudpickle.dumps(own)
    splits = np.zeros(size, dtype=np.int32)
    for destination in sorted(destinations):
        splits[destination] = len(payload)
    data = np.frombuffer(payload * len(destinations), dtype=np.uint8)
    received, received_splits = ops.wait_for(ops.alltoall_async, NumpyAdapter(), data, splits,
                                             "elastic.sharded.buddy")
    merged, offset, raw = {}, 0, np.asarray(received).tobytes()
    for length in np.asarray(received_splits).tolist():
        if length:
            merged.update(cloudpickle.loads(raw[offset:offset + length]))
        offset += length
    return merged
