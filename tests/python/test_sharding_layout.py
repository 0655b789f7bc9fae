"""rvod.common.sharding without ranks: balanced chunks, shard layouts, and state moved between shards of
one world size and another through whole parameters (NumPy stands in for a framework's tensors)."""

from __future__ import annotations

import numpy as np
import pytest

from rvod.common.sharding import Param, ShardLayout, StateOps, buddy_of, chunk, gather_held, join_shards, split_params

OPS = StateOps(is_per_element=lambda v, n: isinstance(v, np.ndarray) and v.ndim == 1 and v.size == n,
               flat_slice=lambda v, a, b: v.reshape(-1)[a:b], cat=np.concatenate,
               zeros=lambda like, n: np.zeros(n, like.dtype))
PARAMS = [Param(0, 0, 7, "float32"), Param(1, 0, 3, "float32"), Param(2, 0, 5, "float64"), Param(4, 1, 1, "float32")]


@pytest.mark.parametrize("numel,size", [(0, 3), (1, 4), (7, 3), (12, 4), (4097, 5)])
def test_chunks_are_balanced_contiguous_and_the_first_ranks_take_the_extra(numel, size):
    bounds = [chunk(numel, size, r) for r in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(size - 1))
    lengths = [b - a for a, b in bounds]
    assert lengths == sorted(lengths, reverse=True) and max(lengths) - min(lengths) <= 1


def test_one_shard_per_group_and_dtype_holding_this_ranks_chunks():
    layout = ShardLayout(PARAMS, 3, 1)
    assert [(s.group, s.dtype, s.numel) for s in layout.shards] == [(0, "float32", 2 + 1), (0, "float64", 2),
                                                                     (1, "float32", 0)]
    assert [(p.param.index, p.start, p.stop, p.offset) for p in layout.shards[0].pieces] == [(0, 3, 5, 0), (1, 1, 2, 2)]
    assert sum(ShardLayout(PARAMS, 3, r).shards[0].numel for r in range(3)) == 10


@pytest.mark.parametrize("old,new", [(4, 2), (2, 3), (3, 1)])
def test_state_moves_through_whole_parameters_between_world_sizes(old, new):
    whole = {p.index: {"m": np.arange(p.numel, dtype=np.float64) + 10 * p.index, "step": 5} for p in PARAMS}
    per_element = lambda index, key, value: key == "m"  # noqa: E731
    layouts = [ShardLayout(PARAMS, old, r) for r in range(old)]
    shards = [split_params(whole, layout, OPS, per_element) for layout in layouts]
    assert sum(state["m"].size for states in shards for state in states if state) == 16
    joined = join_shards(layouts, shards, OPS)
    again = [split_params(joined, ShardLayout(PARAMS, new, r), OPS, per_element) for r in range(new)]
    back = join_shards([ShardLayout(PARAMS, new, r) for r in range(new)], again, OPS)
    for index, entry in whole.items():
        assert np.array_equal(back[index]["m"], entry["m"]) and back[index]["step"] == 5


def test_join_refuses_an_incomplete_set_of_shards():
    with pytest.raises(ValueError, match=r"every rank of one job \(ranks \[0, 2\] of 3\)"):
        join_shards([ShardLayout(PARAMS, 3, 0), ShardLayout(PARAMS, 3, 2)], [[{}] * 3, [{}] * 3], OPS)


def test_buddy_copies_fill_a_lost_slice_and_a_lost_pair_is_named():
    def held(rank, size, commit=1):
        description = {**ShardLayout(PARAMS, size, rank).describe(), "commit": commit}
        return rank, (description, [])

    assert buddy_of(2, 3) == 0
    survivors = [dict([held(0, 3), held(2, 3)]), dict([held(2, 3), held(1, 3)]), dict([held(0, 2, commit=0)])]
    assert [d["rank"] for d, _ in gather_held(survivors)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match=r"rank 1 and its buddy rank 2 of the 3-rank world died together"):
        gather_held([dict([held(0, 3), held(2, 3)])])
