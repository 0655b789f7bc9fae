"""rvod.runner.cluster_job: the topology of ranks placed by a cluster engine (Ray, Spark), without one."""

import socket

from rvod.runner.cluster_job import call, failure_message, slots_for_hosts, store_address


def test_ranks_of_a_host_are_its_local_ranks_and_cross_ranks_follow_horovod():
    slots = slots_for_hosts(["a", "b", "a", "c", "b", "a"])
    got = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert got == [
        ("a", 0, 0, 3, 0, 3),
        ("b", 1, 0, 2, 1, 3),
        ("a", 2, 1, 3, 0, 2),
        ("c", 3, 0, 1, 2, 3),
        ("b", 4, 1, 2, 1, 2),
        ("a", 5, 2, 3, 0, 1),
    ]
    assert {s.size for s in slots} == {6}


def test_the_store_listens_on_loopback_only_when_every_rank_is_on_one_host():
    assert store_address(["h", "h"], "10.0.0.1") == "127.0.0.1"
    assert store_address(["h", "g"], "10.0.0.1") == "10.0.0.1"


def test_a_raising_function_comes_back_as_its_traceback_with_the_rank():
    assert call(3, lambda a, b: a + b, (1,), {"b": 2}) == (True, 3)
    succeeded, failure = call(3, lambda: 1 / 0, (), {})
    assert not succeeded and failure.rank == 3 and not failure.secondary and failure.host == socket.gethostname()
    assert failure.detail.startswith("rank 3 raised:\nTraceback")
    assert "ZeroDivisionError: division by zero" in failure.detail


def test_the_failure_shown_is_the_first_that_another_rank_did_not_cause():
    from rvod.exceptions import RvodInternalError

    def broken():
        raise RvodInternalError("rank 1 is gone")

    _, consequence = call(0, broken, (), {})
    _, cause = call(1, lambda: [][1], (), {})
    assert consequence.secondary
    message = failure_message("where", [consequence, cause])
    assert message.startswith(f"where: rank 1 on {socket.gethostname()} failed: rank 1 raised:\nTraceback")
    assert "IndexError" in message and message.endswith("where: rank(s) [0] failed too")
    assert failure_message("where", [consequence]).startswith("where: rank 0 on ")
