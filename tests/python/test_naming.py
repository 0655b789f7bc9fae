"""Default names of unnamed collectives (rvod.common.naming), in one process: numbers refused ops give back
are taken again before new ones, the object helpers count apart from tensor ops, and join's restart touches the
global set only. The multi-rank behaviour is tested in test_refusals.py."""

from __future__ import annotations

import pytest

from rvod.common import naming


@pytest.fixture(autouse=True)
def fresh_counters():
    naming.reset()
    yield
    naming.reset()


def test_a_refused_name_is_taken_again_by_the_next_unnamed_op():
    assert naming.next_suffix() == "noname.1"
    refused = naming.next_name("allreduce")
    assert refused == "allreduce.noname.2"
    naming.give_back([refused])
    assert naming.next_suffix() == "noname.2"
    assert naming.next_suffix() == "noname.3"


def test_a_refused_group_gives_back_all_its_numbers_in_order():
    names = [naming.next_name("grouped_allgather", 4) for _ in range(3)]
    assert names == [f"grouped_allgather.noname.{n}" for n in (1, 2, 3)]
    naming.give_back(names, 4)
    assert naming.next_suffix(0) == "noname.1"  # other sets are untouched
    assert [naming.next_suffix(4) for _ in range(4)] == ["noname.1", "noname.2", "noname.3", "noname.4"]


def test_object_helpers_count_apart_from_tensor_ops():
    for _ in range(5):
        naming.next_suffix()
    assert naming.next_object_name("allgather_object") == "allgather_object.noname.1"
    refused = naming.next_object_name("broadcast_object")
    naming.give_back([refused], objects=True)
    assert naming.next_object_name("allgather_object") == "allgather_object.noname.2"
    assert naming.next_suffix() == "noname.6"


def test_join_restarts_the_global_set_only():
    naming.next_suffix(0)
    naming.give_back([naming.next_suffix(0)], 0)
    naming.next_object_name("allgather_object", 0)
    naming.next_suffix(3)
    naming.restart_global()
    assert naming.next_suffix(0) == "noname.1"
    assert naming.next_object_name("allgather_object", 0) == "allgather_object.noname.1"
    assert naming.next_suffix(3) == "noname.2"
