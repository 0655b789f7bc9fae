"""benches/scale_model.py: the alpha-beta model's algorithms count the messages, bytes and latencies they should
(no engine, no subprocess)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import scale_model as m  # noqa: E402

MiB = 1 << 20
UNIT = m.Params(alpha_us=1.0, o_us=0.25, beta_ns_per_byte=0.0)  # a time is a count of latencies


def test_one_message_costs_alpha_plus_bytes():
    params = m.Params(alpha_us=3.0, o_us=0.5, beta_ns_per_byte=0.08)
    sim = m.Sim(2, params)
    sim.send([0], [1], 1000)
    assert sim.time() == pytest.approx(3.0 + 1000 * 0.08e-3)
    assert sim.max_msgs() == 1


@pytest.mark.parametrize("n, steps, per_rank", [(5, 4, 3), (8, 3, 3), (1000, 11, 10), (1024, 10, 10)])
def test_recursive_doubling_steps(n, steps, per_rank):
    """log2(p) exchanges, plus a fold and an unfold when N is not a power of two; at most log2(p)+1 sends a rank."""
    p = 1 << int(math.log2(n))
    assert steps == int(math.log2(p)) + (2 if p < n else 0)
    sim = m.Sim(n, UNIT)
    m.recursive_doubling(sim, 4)
    assert sim.max_msgs() == per_rank
    assert sim.time() <= steps + 1e-9  # ranks outside the fold do not wait for it, so it can be less
    assert sim.time() >= int(math.log2(p))


@pytest.mark.parametrize("n", [2, 3, 8, 64, 1000])
def test_ring_bytes_per_rank_is_the_bandwidth_bound(n):
    size = 256 * MiB
    sim = m.Sim(n, m.Params(alpha_us=3.0, o_us=0.5, beta_ns_per_byte=0.08))
    m.ring_allreduce(sim, size)
    assert sim.max_bytes() == pytest.approx(2 * (n - 1) / n * size)
    assert sim.max_msgs() == 2 * (n - 1)
    bound = m.ring_bound_us(n, size, sim.p)
    assert sim.time() == pytest.approx(bound + 2 * (n - 1) * 3.0)


@pytest.mark.parametrize("n", [4, 64, 1024])
def test_before_header_round_sends_n_minus_1_per_rank(n):
    sim = m.run("before", "cached", n, UNIT)
    assert sim.max_msgs() == n - 1
    # the rank's N-1 sends leave one after another: (N-2) overheads, then one latency
    assert sim.time() == pytest.approx((n - 2) * UNIT.o_us + UNIT.alpha_us)


def test_uniform_fast_path_matches_the_per_rank_arrays():
    """A ring and an all-to-all computed once for all ranks give what the per-rank event arrays give."""
    params = m.Params(alpha_us=2.0, o_us=0.6, beta_ns_per_byte=0.1, gamma_ns_per_byte=0.05)
    fast, slow = m.Sim(6, params), m.Sim(6, params)
    slow._arrays()
    for sim in (fast, slow):
        m.alltoall(sim, 100)
        m.ring_allreduce(sim, 6000)
    assert fast.uniform and fast.time() == pytest.approx(slow.time())
    assert fast.max_msgs() == slow.max_msgs() == 5 + 10


def test_star_queues_at_rank_zero_and_the_tree_does_not():
    n = 1024
    star, tree = m.Sim(n, UNIT), m.Sim(n, UNIT)
    m.star_gather(star, 128)
    m.binomial_gather(tree, 128)
    assert star.time() == pytest.approx((n - 2) * UNIT.o_us + UNIT.alpha_us)
    assert tree.time() == pytest.approx(10)
    assert tree.max_bytes() == 512 * 128  # rank 512 forwards half the job's requests


def test_binomial_bcast_reaches_every_rank_within_ceil_log2_latencies():
    """The root's sends leave an overhead apart, not a latency apart, so it can take less than ceil(log2 N)."""
    for n in (5, 64, 1000):
        sim = m.Sim(n, UNIT)
        m.binomial_bcast(sim, 64)
        assert math.log2(n) / 2 <= sim.time() <= math.ceil(math.log2(n)) + 1e-9
        assert sim.a["ready"][1:].min() >= UNIT.alpha_us  # every rank but the root received it
        assert sim.a["msgs"].sum() == n - 1


@pytest.mark.parametrize("scenario", m.SCENARIOS)
def test_times_grow_with_n(scenario):
    for design in m.DESIGNS:
        if not m.applies(design, scenario):
            continue
        times = [m.run(design, scenario, n, m.CLUSTER).time() for n in (16, 64, 256, 1024)]
        if design == "after" and scenario == "allreduce_256MiB":
            # The algorithm changes with N (the ring up to 256 ranks, Rabenseifner's at 1,024, where the
            # ring's blocks fall below 512 KiB): never slower than a plain ring, negotiation included.
            rings = [m.run("ring", scenario, n, m.CLUSTER).time() for n in (16, 64, 256, 1024)]
            assert all(t <= 1.01 * r for t, r in zip(times, rings)), (times, rings)
            assert times[3] < 0.9 * rings[3], (times, rings)
            continue
        assert times == sorted(times), (design, scenario, times)


def test_issue_targets_in_the_model_at_1024():
    results = m.evaluate(m.CLUSTER, ns=(1024,))
    assert results[("cached", "after", 1024)]["lat"] <= 12
    assert results[("allreduce_4B", "after", 1024)]["lat"] <= 2 * 10
    assert results[("cached", "before", 1024)]["msgs"] == 1023
    assert results[("cached", "after", 1024)]["msgs"] == 10
    verdicts = {label: ok for label, _, ok in m.targets(results, m.CLUSTER)}
    assert any("after-hier" in label and ok for label, ok in verdicts.items())
    # Every target holds for rvod's own choice too (the flat 256 MiB allreduce at 1,024 ranks is Rabenseifner's).
    assert all(verdicts.values()), verdicts
    assert m.after_allreduce_algorithm(1024, 256 * MiB) == "rabenseifner"
    assert m.after_allreduce_algorithm(1000, 256 * MiB) == "ring"
    assert m.after_allreduce_algorithm(256, 256 * MiB) == "ring"


def test_rabenseifner_moves_the_bandwidth_bound_in_2_log2_n_steps():
    n, size = 64, 4 * MiB
    sim = m.Sim(n, m.Params(alpha_us=1.0, o_us=0.25, beta_ns_per_byte=0.1))
    m.rabenseifner(sim, size)
    assert sim.max_msgs() == 2 * 6
    assert sim.max_bytes() == pytest.approx(2 * (n - 1) / n * size)
