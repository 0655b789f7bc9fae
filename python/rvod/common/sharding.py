"""Sharded optimizer state (ZeRO-1/2): which elements of every parameter a rank owns, and moving optimizer
state between that layout and whole parameters, for every shim's sharded ``DistributedOptimizer``.

Layout. Every trained parameter, flattened, is cut into ``size`` consecutive chunks of balanced lengths,
the first ranks taking one element more (as ``reducescatter`` splits dim 0 and ``allgather`` joins it), and
rank r owns the r-th chunk of each. Rank r's *shard* of a (parameter group, dtype) is its chunks of that
group's parameters of that dtype, concatenated in parameter order: in the flattened order "rank 0's chunks,
then rank 1's, ..." every rank owns one contiguous slice, and the slices differ in length by at most one
element per parameter. So a parameter's gradient is reduce-scattered straight into its owners' shards
(one collective per parameter, started by its gradient hook and fused by the engine), and the updated
parameter is allgathered from them: per step the bytes of one allreduce.

Optimizer state is per shard: ``{key: value}`` where a value the length of the shard is per element
(Adam's moments) and anything else is one value for the whole shard (Adam's step). ``join_shards`` turns
the shards of every rank into per-parameter state, ``split_params`` per-parameter state into one rank's
shards; a framework supplies the few tensor operations (``StateOps``). Nothing here sends anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

SHARDED_KEY = "rvod_sharded"  # the key of a sharded state dict that holds its layout


def chunk(numel, size, rank):
    """``(start, stop)`` of ``rank``'s chunk of ``numel`` elements cut into ``size`` balanced chunks."""
    base, extra = divmod(numel, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Param:
    """A trained parameter as the layout sees it: its position among all parameters of the optimizer's
    groups (the index a plain optimizer's state dict uses), its group, size and dtype name."""

    index: int
    group: int
    numel: int
    dtype: str


@dataclass(frozen=True)
class Piece:
    """``param``'s elements ``[start, stop)`` at ``offset`` in a shard."""

    param: Param
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Shard:
    group: int
    dtype: str
    pieces: tuple
    numel: int


class ShardLayout:
    """Rank ``rank``'s shards, among ``size`` ranks, of ``params`` (a list of ``Param``): one shard per
    (group, dtype), ordered by group, then by the dtype's first appearance in the group."""

    def __init__(self, params, size, rank):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not one of {size} ranks")
        self.params, self.size, self.rank = list(params), size, rank
        keys = []
        members = {}
        for param in self.params:
            key = (param.group, param.dtype)
            if key not in members:
                keys.append(key)
                members[key] = []
            members[key].append(param)
        keys.sort(key=lambda k: k[0])  # stable: dtype order within a group stays that of first appearance
        self.shards = []
        self.piece_of = {}  # param index -> its Piece here
        for group, dtype in keys:
            pieces, offset = [], 0
            for param in members[(group, dtype)]:
                start, stop = chunk(param.numel, size, rank)
                piece = Piece(param, start, stop, offset)
                pieces.append(piece)
                self.piece_of[param.index] = piece
                offset += stop - start
            self.shards.append(Shard(group, dtype, tuple(pieces), offset))

    def describe(self):
        """The layout as plain data for a state dict (``from_description`` rebuilds it)."""
        return {"size": self.size, "rank": self.rank,
                "params": [(p.index, p.group, p.numel, p.dtype) for p in self.params]}

    @classmethod
    def from_description(cls, description, rank=None):
        params = [Param(*entry) for entry in description["params"]]
        return cls(params, description["size"], description["rank"] if rank is None else rank)

    def same_parameters(self, other):
        return self.params == other.params


def check_own_shard(description, layout):
    """Raise ValueError unless the sharded state dict with layout ``description`` is ``layout``'s own
    (same ranks, rank and parameters): another job's or rank's must be loaded as the list of every rank's."""
    saved = ShardLayout.from_description(description)
    if saved.size != layout.size or saved.rank != layout.rank or not saved.same_parameters(layout):
        raise ValueError(f"this state dict is rank {saved.rank}'s shard of a sharded optimizer of {saved.size} "
                         f"ranks; this one is rank {layout.rank} of {layout.size}: load the list of every rank's "
                         "state_dict() (resharded here) or a consolidated one (consolidate_state_dict())")


@dataclass(frozen=True)
class StateOps:
    """The tensor operations state moves need: ``is_per_element(value, numel)`` (a value the shape of a
    shard of ``numel`` elements), ``flat_slice(value, start, stop)`` (of a value flattened), ``cat(values)``
    (1-D, in order; never given an empty list) and ``zeros(like, numel)`` (1-D, ``like``'s dtype)."""

    is_per_element: Callable[[Any, int], bool]
    flat_slice: Callable[[Any, int, int], Any]
    cat: Callable[[list], Any]
    zeros: Callable[[Any, int], Any]


def join_shards(layouts, states, ops):
    """Per-parameter state ``{param index: {key: value}}`` (per-element values flat, whole parameters) from
    the shards of every rank of one job: ``layouts[r]`` is rank r's ``ShardLayout`` and ``states[r][s]``
    the state of its shard s (``{}`` when the optimizer has none for it). A shard-wide value is taken from
    the lowest rank holding state for the parameter's shard."""
    size = layouts[0].size
    if sorted(layout.rank for layout in layouts) != list(range(size)) or any(
            layout.size != size or not layout.same_parameters(layouts[0]) for layout in layouts):
        raise ValueError("the sharded state dicts must be those of every rank of one job (ranks "
                         f"{sorted(layout.rank for layout in layouts)} of {size}), with the same parameters")
    order = sorted(range(len(layouts)), key=lambda i: layouts[i].rank)
    joined = {}
    for s, shard in enumerate(layouts[0].shards):
        held = [(layouts[i], states[i][s]) for i in order if states[i][s]]
        if not held:
            continue
        keys = list(held[0][1])
        for piece in shard.pieces:
            index = piece.param.index
            entry = {}
            for key in keys:
                first = held[0][1][key]
                if not ops.is_per_element(first, held[0][0].shards[s].numel):
                    entry[key] = first
                    continue
                parts = []
                for i in order:
                    layout, state = layouts[i], states[i][s]
                    own = layout.piece_of[index]
                    value = state.get(key) if state else None
                    parts.append(ops.flat_slice(value, own.offset, own.offset + own.stop - own.start)
                                 if value is not None else ops.zeros(first, own.stop - own.start))
                entry[key] = ops.cat(parts)
            joined[index] = entry
    return joined


def split_params(joined, layout, ops, per_element):
    """``layout``'s shard states (a list, ``{}`` for a shard whose parameters have no state) from
    per-parameter state ``{param index: {key: value}}``; ``per_element(index, key, value)`` says whether a
    value holds one entry per element of the parameter. A parameter without state gets zeros for the
    per-element keys of the other parameters of its shard."""
    states = []
    for shard in layout.shards:
        with_state = [piece for piece in shard.pieces if joined.get(piece.param.index)]
        if not with_state:
            states.append({})
            continue
        template = joined[with_state[0].param.index]
        state = {}
        for key, value in template.items():
            if not per_element(with_state[0].param.index, key, value):
                state[key] = value
                continue
            parts = []
            for piece in shard.pieces:
                source = joined.get(piece.param.index, {}).get(key)
                parts.append(ops.flat_slice(source, piece.start, piece.stop) if source is not None
                             else ops.zeros(value, piece.stop - piece.start))
            state[key] = ops.cat(parts) if parts else ops.zeros(value, 0)
        states.append(state)
    return states


def buddy_of(rank, size):
    """The rank that keeps a copy of ``rank``'s slice (elastic commits): the next one, round the ring."""
    return (rank + 1) % size


def gather_held(held_by_rank):
    """From what every rank of a new world holds (a list, in rank order, of ``{old rank: (layout
    description with the number of its ``"commit"``, shard states)}``: its own slice of the last commit and its
    buddy copy), the slices of rank 0's last commit, in old-rank order (a rank that joined since holds only
    a fresh slice of another commit, which does not count). Raises RuntimeError naming the old ranks whose
    slice and buddy copy were both lost."""
    commits = {(d["size"], d["commit"]) for d, _ in held_by_rank[0].values()}
    if len(commits) != 1:
        raise RuntimeError("rank 0 holds optimizer slices of different commits")
    size, commit = commits.pop()
    merged = {}
    for held in held_by_rank:
        for old_rank, (description, states) in held.items():
            if (description["size"], description["commit"]) == (size, commit) and old_rank not in merged:
                merged[old_rank] = (description, states)
    missing = [r for r in range(size) if r not in merged]
    if missing:
        lost = ", ".join(f"rank {r} and its buddy rank {buddy_of(r, size)}" for r in missing)
        raise RuntimeError(f"the sharded optimizer state of the last commit is lost: {lost} of the {size}-rank world "
                           "died together, and no other rank keeps their slices; go back to the last "
                           "consolidated checkpoint (what consolidate_state_dict() returned, saved)")
    return [merged[r] for r in range(size)]
