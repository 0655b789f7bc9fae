"""A message-level alpha-beta model of rvod's negotiation and allreduce at 64 .. 16,384 ranks (issue 32, item 6).

    python benches/scale_model.py                      # tables for both parameter sets, targets, CSV (and PNG)
    python benches/scale_model.py --out bench-out/scale --params bench-out/scale_fit/fit.json

Every message is an event: a rank's sends leave one after another through its send port (each holds it for
o + m*beta), a message arrives alpha + m*beta after it left, and a rank's receives are taken one after another
(each holds its receive port for o + m*beta), so a rank that sends or receives k messages pays k overheads in
sequence, and a star on rank 0 queues at rank 0. A rank starts its next step when its sends are out and its
receives are in (plus gamma per reduced byte). One message alone costs exactly alpha + m*beta.

Four designs, each predicting (a) a cached steady-state negotiation round, (b) an uncached round, (c) a 4 B
allreduce with its negotiation, (d) a 256 MiB allreduce with its negotiation:

- before: rvod before issue 32. Round headers all-to-all (N-1 per rank), uncached requests to rank 0 and its
  response list back as stars, allreduces <= 16 KiB riding in the headers, recursive doubling <= 64 KiB,
  ring above.
- after: issue 32's design. The round's summary combined by recursive doubling (ranks beyond the largest power
  of two fold onto a partner first and get the result back last), uncached requests gathered along a binomial
  tree (lists concatenate on the way up) and the response list broadcast along one, data in the headers only
  while N <= 8, then src/ring/choice.rs's choice: recursive doubling <= 32 KiB, Rabenseifner's until each
  rank's block (S/N) reaches 64 KiB (512 KiB on more than 16 ranks, a power of two), the ring from there;
  `after-hier` is the hierarchical variant for large allreduces (Rabenseifner <= 4 MiB, above: ring inside a host of --ranks-per-host over shared memory, ring
  across hosts, ring inside the host again).
- horovod: Horovod's controller. One MPI_Allreduce (bitwise AND) of the cache bit vector per cycle, a second
  one (OR) only when a rank has invalid bits (not in steady state); uncached: MPI_Gather of the lengths and
  MPI_Gatherv of the request lists to rank 0, MPI_Bcast of the length and of the response list (binomial
  trees here); data by MPI/NCCL: recursive doubling for small, ring for large.
- ring: a plain ring with no negotiation, the reference for the bandwidth bound 2(N-1)/N * S * beta.

Columns: time in us, "lat" = the same scenario with beta = gamma = 0 in units of alpha (message latencies on
the critical path, serialised overheads included), and the most messages any rank sends. Targets (issue 32 at
1,024 ranks, in the model): cached round <= 12 latencies, 4 B allreduce <= 2 log2(N) latencies, 256 MiB
allreduce >= 0.9 x the ring's bandwidth bound. See docs/scale.md for the parameters and their sources.
"""

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
NS = (64, 256, 1024, 4096, 16384)
DESIGNS = ("before", "after", "after-hier", "horovod", "ring")
SCENARIOS = ("cached", "uncached", "allreduce_4B", "allreduce_256MiB")
SCENARIO_TITLES = {
    "cached": "(a) cached steady-state negotiation round",
    "uncached": "(b) uncached round (requests to rank 0, responses back)",
    "allreduce_4B": "(c) 4 B allreduce, negotiation included",
    "allreduce_256MiB": "(d) 256 MiB allreduce, negotiation included",
}
TARGET_N = 1024

# rvod's thresholds (src/coordinator/negotiation.rs EAGER_TENSOR_BYTES, src/ring/allreduce.rs RING_THRESHOLD_BYTES)
EAGER_BYTES = 16 * KiB
RECURSIVE_DOUBLING_BYTES = 64 * KiB
RABENSEIFNER_BYTES = 4 * MiB  # after-hier: Rabenseifner up to here, the hierarchical allreduce above
# after: src/ring/choice.rs choose_allreduce on more than 4 ranks (the model's N): recursive doubling up to
# 32 KiB, Rabenseifner's until each rank's block reaches ring_min_block_bytes(N), the ring from there.
RECURSIVE_DOUBLING_BYTES_MANY_RANKS = 32 * KiB
RING_MIN_BLOCK_BYTES = 64 * KiB
RING_MIN_BLOCK_BYTES_MANY_RANKS = 512 * KiB
RING_MEASURED_MAX_RANKS = 16


def ring_min_block_bytes(n):
    """src/ring/choice.rs ring_min_block_bytes: larger blocks before the ring on many ranks, a power of two."""
    if n > RING_MEASURED_MAX_RANKS and n & (n - 1) == 0:
        return RING_MIN_BLOCK_BYTES_MANY_RANKS
    return RING_MIN_BLOCK_BYTES


def after_allreduce_algorithm(n, nbytes):
    """The flat algorithm rvod chooses after issue 32 for an allreduce of nbytes on n > 4 ranks."""
    if nbytes <= RECURSIVE_DOUBLING_BYTES_MANY_RANKS:
        return "recursive_doubling"
    if nbytes // n >= ring_min_block_bytes(n):
        return "ring"
    return "rabenseifner"
EAGER_MAX_RANKS = 8  # after: data rides in the headers only while N <= 8

# Message sizes (bytes) of the control traffic, from the wire formats (src/protocol/round.rs), rounded up.
FRAME_BYTES = 16  # magic, kind, version, length
CACHED_TENSORS = 200  # cache bits in use in a steady-state step (a model with 200 gradient tensors)
REQUEST_BYTES = 128  # one uncached request: name, op, dtype, shape, device, process set
RESPONSE_BYTES = 128  # one response in the list


def header_bytes(cached_tensors=CACHED_TENSORS):
    """A round header / summary: frame, flags, the hit and the invalid bit sets."""
    return FRAME_BYTES + 1 + 2 * math.ceil(cached_tensors / 8)


def horovod_bitvector_bytes(cached_tensors=CACHED_TENSORS):
    """Horovod's bit vector: (active bits + 3 status bits) rounded up to 64-bit words (response_cache.cc)."""
    return 8 * math.ceil((cached_tensors + 3) / 64)


@dataclass(frozen=True)
class Params:
    """One machine's costs. alpha: one message end to end (us); o: the part of it a rank's port is held per
    message, at each end (us, <= alpha/2); beta, gamma: per byte moved, per byte reduced (ns/B). local_*: the
    same inside one host (the hierarchical variant); None = the same as across hosts."""

    alpha_us: float
    o_us: float
    beta_ns_per_byte: float
    gamma_ns_per_byte: float = 0.0
    local_alpha_us: float = None
    local_o_us: float = None
    local_beta_ns_per_byte: float = None
    ranks_per_host: int = 8

    def local(self):
        return replace(self, alpha_us=self.local_alpha_us if self.local_alpha_us is not None else self.alpha_us,
                       o_us=self.local_o_us if self.local_o_us is not None else self.o_us,
                       beta_ns_per_byte=(self.local_beta_ns_per_byte if self.local_beta_ns_per_byte is not None
                                         else self.beta_ns_per_byte))

    def latency_only(self):
        """alpha = 1, no per-byte costs: a simulated time is then a count of message latencies."""
        scale = 1.0 / self.alpha_us
        la = self.local()
        return replace(self, alpha_us=1.0, o_us=self.o_us * scale, beta_ns_per_byte=0.0, gamma_ns_per_byte=0.0,
                       local_alpha_us=la.alpha_us * scale, local_o_us=la.o_us * scale, local_beta_ns_per_byte=0.0)


# This machine (2 vCPUs, shared memory), fitted by benches/scale_fit.py to its 2-rank jobs (the only ones with a
# core per rank; o = alpha/2: on one host a message's whole cost is work at its two ends); see docs/scale.md.
THIS_MACHINE = Params(alpha_us=5.476, o_us=2.738, beta_ns_per_byte=0.2154)
# A 100 Gbit/s cluster: alpha 3 us across hosts (RDMA/RoCE small-message latency 1.5-3 us, plus software),
# beta = 1/(12.5 GB/s) = 0.08 ns/B, o = 0.5 us per message (a NIC doorbell and completion), one NIC per rank;
# 8 ranks per host over shared memory / NVLink-class links (alpha 1 us, o 0.2 us, 0.02 ns/B = 50 GB/s).
CLUSTER = Params(alpha_us=3.0, o_us=0.5, beta_ns_per_byte=0.08, local_alpha_us=1.0, local_o_us=0.2,
                 local_beta_ns_per_byte=0.02, ranks_per_host=8)


def size_label(size):
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


class Sim:
    """Per-rank clocks of N ranks: `ready` (the rank may start its next step), its send and receive ports, and
    per-rank counts of messages and bytes sent. While every rank's clocks are equal ("uniform") and a step is
    a permutation (every rank sends one message of the same size and receives one), all ranks stay equal and
    the step is computed once, for all: that is what keeps a 16,384-rank ring (32,766 steps) cheap."""

    def __init__(self, n, params):
        self.n, self.p = n, params
        self.alpha, self.o = params.alpha_us, params.o_us
        self.beta, self.gamma = params.beta_ns_per_byte / 1e3, params.gamma_ns_per_byte / 1e3
        self.uniform = True
        self.u = {"ready": 0.0, "send": 0.0, "recv": 0.0, "msgs": 0, "bytes": 0.0}
        self.a = None

    def with_params(self, params):
        """The same clocks, other link costs from now on (a phase inside a host, then across hosts)."""
        self.p, self.alpha, self.o = params, params.alpha_us, params.o_us
        self.beta, self.gamma = params.beta_ns_per_byte / 1e3, params.gamma_ns_per_byte / 1e3
        return self

    def _arrays(self):
        if self.uniform:
            u, n = self.u, self.n
            self.a = {"ready": np.full(n, u["ready"]), "send": np.full(n, u["send"]), "recv": np.full(n, u["recv"]),
                      "msgs": np.full(n, u["msgs"], dtype=np.int64), "bytes": np.full(n, u["bytes"])}
            self.uniform = False
        return self.a

    def time(self):
        """When the last rank is done."""
        return self.u["ready"] if self.uniform else float(self.a["ready"].max())

    def max_msgs(self):
        return self.u["msgs"] if self.uniform else int(self.a["msgs"].max())

    def max_bytes(self):
        return self.u["bytes"] if self.uniform else float(self.a["bytes"].max())

    def sync(self):
        """Every rank waits for the last (used between phases whose start the model does not overlap)."""
        t = self.time()
        if self.uniform:
            self.u.update(ready=t, send=max(self.u["send"], t), recv=max(self.u["recv"], t))
        else:
            a = self.a
            a["ready"][:] = t
            np.maximum(a["send"], t, out=a["send"])
            np.maximum(a["recv"], t, out=a["recv"])

    def permutation(self, partner, nbytes, reduce=False):
        """Every rank sends `nbytes` to partner(rank) and receives `nbytes` from its inverse."""
        if self.uniform:
            u, m = self.u, nbytes
            start = max(u["ready"], u["send"])
            u["send"] = start + self.o + m * self.beta
            delivered = max(start + self.alpha + m * self.beta, u["recv"] + self.o + m * self.beta)
            u["recv"] = delivered
            u["ready"] = max(u["send"], delivered) + (m * self.gamma if reduce else 0.0)
            u["msgs"] += 1
            u["bytes"] += m
            return
        ranks = np.arange(self.n)
        self.send(ranks, partner(ranks), nbytes, reduce)

    def send(self, src, dst, nbytes, reduce=False, at=None):
        """Messages src[i] -> dst[i] of nbytes[i] (or one size), in this order on each sender. They leave when the
        sender is ready (or at time `at`: sends that do not wait for this phase's receives)."""
        a = self._arrays()
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        if src.size == 0:
            return
        m = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
        cost = self.o + m * self.beta
        leave = a["ready"][src] if at is None else np.asarray(at, dtype=np.float64)[src]
        # Each sender's messages one after another: end_i = max(leave_i, end_{i-1}) + cost_i, started from the
        # port's free time; a running maximum per sender (the max-plus form of that recursion).
        order = np.argsort(src, kind="stable")
        s, c, lv = src[order], cost[order], leave[order]
        end = _grouped_serial(s, lv, c, a["send"])
        start = end - c
        arrive = np.empty_like(start)
        arrive[order] = start + self.alpha + m[order] * self.beta
        a["send"][s[_last_of_runs(s)]] = end[_last_of_runs(s)]
        # Each receiver takes its messages in arrival order, one after another.
        order_r = np.lexsort((arrive, dst))
        d, ar, rc = dst[order_r], arrive[order_r], cost[order_r]
        delivered = _grouped_serial(d, ar - rc, rc, a["recv"])
        a["recv"][d[_last_of_runs(d)]] = delivered[_last_of_runs(d)]
        ready = a["ready"].copy()
        np.maximum.at(ready, s, end)
        np.maximum.at(ready, d, delivered)
        if reduce and self.gamma:
            np.add.at(ready, d, m[order_r] * self.gamma)
        a["ready"] = ready
        np.add.at(a["msgs"], src, 1)
        np.add.at(a["bytes"], src, m)
        if np.ptp(ready) == 0 and np.ptp(a["send"]) == 0 and np.ptp(a["recv"]) == 0 and np.ptp(a["msgs"]) == 0 \
                and np.ptp(a["bytes"]) == 0:
            self.u = {"ready": float(ready[0]), "send": float(a["send"][0]), "recv": float(a["recv"][0]),
                      "msgs": int(a["msgs"][0]), "bytes": float(a["bytes"][0])}
            self.uniform = True


def _last_of_runs(sorted_keys):
    """Index of the last element of each run of equal keys in a sorted array."""
    return np.flatnonzero(np.r_[sorted_keys[1:] != sorted_keys[:-1], True])


def _grouped_serial(group, ready, cost, port_free):
    """end_i = max(ready_i, end_{i-1}) + cost_i within each run of equal `group` (sorted), the first one started
    no earlier than port_free[group]. With C the running sum of cost in the group, end_i - C_i is the running
    maximum of (ready_j - C_{j-1}), seeded with port_free; runs are kept apart by an offset per group."""
    csum = np.cumsum(cost)
    first = np.r_[True, group[1:] != group[:-1]]
    idx = np.flatnonzero(first)
    base = np.repeat(csum[idx] - cost[idx], np.diff(np.r_[idx, group.size]))  # cumsum before each group
    c_incl = csum - base
    c_excl = c_incl - cost
    x = ready - c_excl
    x[first] = np.maximum(x[first], port_free[group[first]])
    run = np.cumsum(first)
    span = float(np.max(np.abs(x))) * 4 + 1.0
    shifted = x + run * span
    x = np.maximum.accumulate(shifted) - run * span
    return x + c_incl


# --- the algorithms ---------------------------------------------------------------------------------------

def alltoall(sim, nbytes, reduce=False):
    """Every rank sends `nbytes` to every other rank (to rank+1, rank+2, ... in turn), all leaving at once."""
    n = sim.n
    if sim.uniform:
        u, m = sim.u, nbytes
        phase_start = u["ready"]
        for _ in range(1, n):
            start = max(phase_start, u["send"])
            u["send"] = start + sim.o + m * sim.beta
            u["recv"] = max(start + sim.alpha + m * sim.beta, u["recv"] + sim.o + m * sim.beta)
        u["msgs"] += n - 1
        u["bytes"] += (n - 1) * m
        u["ready"] = max(u["ready"], u["send"], u["recv"]) + ((n - 1) * m * sim.gamma if reduce else 0.0)
        return
    at = sim.a["ready"].copy()
    ranks = np.arange(n)
    for k in range(1, n):
        sim.send(ranks, (ranks + k) % n, nbytes, reduce, at=at)


def core_size(n):
    return 1 << (n.bit_length() - 1)


def fold_in(sim, nbytes, reduce):
    """Ranks p.. (p the largest power of two <= N) hand their buffer to rank - p; returns p."""
    p = core_size(sim.n)
    if p < sim.n:
        extra = np.arange(p, sim.n)
        sim.send(extra, extra - p, nbytes, reduce)
    return p


def fold_out(sim, p, nbytes):
    """Ranks below N - p hand the result back to the ranks that folded onto them."""
    if p < sim.n:
        extra = np.arange(p, sim.n)
        sim.send(extra - p, extra, nbytes)


def exchange_with_xor(sim, p, dist, nbytes, reduce):
    """One step among the power-of-two core: every rank r < p exchanges with r ^ dist."""
    if p == sim.n:
        sim.permutation(lambda r: r ^ dist, nbytes, reduce)
    else:
        core = np.arange(p)
        sim.send(core, core ^ dist, nbytes, reduce)


def recursive_doubling(sim, nbytes, reduce=True):
    """Exchange with rank ^ 2^k for k < log2(p), p the largest power of two <= N; ranks p.. first fold onto
    rank - p and get the result back at the end (2 more steps)."""
    p = fold_in(sim, nbytes, reduce)
    dist = 1
    while dist < p:
        exchange_with_xor(sim, p, dist, nbytes, reduce)
        dist <<= 1
    fold_out(sim, p, nbytes)


def rabenseifner(sim, nbytes, reduce=True):
    """Reduce-scatter by recursive halving, then allgather by recursive doubling, on the power-of-two core
    (the others fold in first and get the result last, with the whole vector)."""
    p = fold_in(sim, nbytes, reduce)
    sizes = []
    dist, size = p // 2, nbytes / 2
    while dist >= 1:
        sizes.append((dist, size))
        dist, size = dist // 2, size / 2
    for dist, size in sizes:
        exchange_with_xor(sim, p, dist, size, reduce)
    for dist, size in reversed(sizes):
        exchange_with_xor(sim, p, dist, size, False)
    fold_out(sim, p, nbytes)


def ring_allreduce(sim, nbytes):
    """Reduce-scatter then allgather around the ring: 2(N-1) steps of S/N bytes to rank + 1."""
    n = sim.n
    chunk = nbytes / n
    for step in range(2 * (n - 1)):
        sim.permutation(lambda r: (r + 1) % n, chunk, reduce=step < n - 1)


def hierarchical_allreduce(sim, nbytes):
    """Ring reduce-scatter inside each host (local links), a ring allreduce of each rank's 1/L share across the
    hosts (every local rank in its own ring, in parallel), a ring allgather inside the host."""
    n, per_host = sim.n, sim.p.ranks_per_host
    if n % per_host or n <= per_host:
        ring_allreduce(sim, nbytes)
        return
    hosts = n // per_host
    cross = sim.p
    sim.with_params(cross.local())

    def local_next(r):
        return r - r % per_host + (r % per_host + 1) % per_host

    for _ in range(per_host - 1):
        sim.permutation(local_next, nbytes / per_host, reduce=True)
    sim.with_params(cross)
    chunk = nbytes / per_host / hosts
    for step in range(2 * (hosts - 1)):
        sim.permutation(lambda r: (r + per_host) % n, chunk, reduce=step < hosts - 1)
    sim.with_params(cross.local())
    for _ in range(per_host - 1):
        sim.permutation(local_next, nbytes / per_host)
    sim.with_params(cross)


def binomial_gather(sim, per_rank_bytes):
    """To rank 0 along a binomial tree: at step k, ranks r with r mod 2^(k+1) = 2^k send all they hold (their
    subtree's lists, concatenated) to r - 2^k."""
    n = sim.n
    held = np.full(n, float(per_rank_bytes))
    mask = 1
    while mask < n:
        src = np.arange(mask, n, 2 * mask)
        sim.send(src, src - mask, held[src])
        held[src - mask] += held[src]
        mask <<= 1


def binomial_bcast(sim, nbytes):
    """From rank 0 along a binomial tree: rank r < 2^k sends to r + 2^k, for 2^k = 1, 2, 4, ..."""
    n = sim.n
    mask = 1
    while mask < n:
        src = np.arange(0, min(mask, n - mask))
        sim.send(src, src + mask, nbytes)
        mask <<= 1


def star_gather(sim, nbytes):
    src = np.arange(1, sim.n)
    sim.send(src, np.zeros_like(src), nbytes)


def star_bcast(sim, nbytes):
    dst = np.arange(1, sim.n)
    sim.send(np.zeros_like(dst), dst, nbytes)


# --- the designs ------------------------------------------------------------------------------------------

def negotiate(design, sim, uncached=False, eager_bytes=0):
    """One negotiation round of `design`; eager_bytes of data ride in the headers where the design does that."""
    n = sim.n
    header = header_bytes()
    if design == "before" or (design in ("after", "after-hier") and n <= EAGER_MAX_RANKS):
        alltoall(sim, header + eager_bytes, reduce=eager_bytes > 0)
        if uncached:
            star_gather(sim, FRAME_BYTES + REQUEST_BYTES)
            star_bcast(sim, FRAME_BYTES + RESPONSE_BYTES)
    elif design in ("after", "after-hier"):
        recursive_doubling(sim, header)
        if uncached:
            binomial_gather(sim, FRAME_BYTES + REQUEST_BYTES)
            binomial_bcast(sim, FRAME_BYTES + RESPONSE_BYTES * 1)
    elif design == "horovod":
        recursive_doubling(sim, horovod_bitvector_bytes())  # MPI_Allreduce(MPI_BAND): recursive doubling
        if uncached:
            binomial_gather(sim, 4)  # MPI_Gather of the lengths
            binomial_gather(sim, REQUEST_BYTES)  # MPI_Gatherv of the request lists
            binomial_bcast(sim, 4)  # MPI_Bcast of the length
            binomial_bcast(sim, RESPONSE_BYTES)  # MPI_Bcast of the response list
    elif design != "ring":
        raise ValueError(f"unknown design {design!r}")


def eager(design, n, nbytes):
    """Whether an allreduce of nbytes rides in the round headers."""
    if design == "before":
        return nbytes <= EAGER_BYTES
    return design in ("after", "after-hier") and n <= EAGER_MAX_RANKS and nbytes <= EAGER_BYTES


def data_allreduce(design, sim, nbytes):
    """The data exchange of an allreduce of nbytes (after its negotiation)."""
    if design == "ring":
        ring_allreduce(sim, nbytes)
    elif design == "after":
        {"recursive_doubling": recursive_doubling, "rabenseifner": rabenseifner,
         "ring": lambda sim, nbytes: ring_allreduce(sim, nbytes)}[after_allreduce_algorithm(sim.n, nbytes)](sim, nbytes)
    elif nbytes <= RECURSIVE_DOUBLING_BYTES:
        recursive_doubling(sim, nbytes)
    elif design in ("after", "after-hier") and nbytes <= RABENSEIFNER_BYTES:
        rabenseifner(sim, nbytes)
    elif design == "after-hier":
        hierarchical_allreduce(sim, nbytes)
    else:
        ring_allreduce(sim, nbytes)


def run(design, scenario, n, params, nbytes=None):
    """Simulate one scenario; returns the Sim (its time(), max_msgs(), max_bytes())."""
    sim = Sim(n, params)
    if scenario == "cached":
        negotiate(design, sim)
    elif scenario == "uncached":
        negotiate(design, sim, uncached=True)
    elif scenario.startswith("allreduce"):
        nbytes = nbytes if nbytes is not None else (4 if scenario == "allreduce_4B" else 256 * MiB)
        if eager(design, n, nbytes):
            negotiate(design, sim, eager_bytes=nbytes)
        else:
            negotiate(design, sim)
            sim.sync()
            data_allreduce(design, sim, nbytes)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    return sim


def allreduce_us(design, n, nbytes, params):
    """Predicted time (us) of one allreduce of nbytes, its negotiation included."""
    return run(design, "allreduce", n, params, nbytes).time()


def applies(design, scenario):
    return not (design == "ring" and scenario in ("cached", "uncached"))


def ring_bound_us(n, nbytes, params):
    """The ring's bandwidth bound: 2(N-1)/N * S * beta."""
    return 2 * (n - 1) / n * nbytes * params.beta_ns_per_byte / 1e3


def evaluate(params, ns=NS):
    """{(scenario, design, n): {"us", "lat", "msgs", "bytes"}} for every applicable combination."""
    results = {}
    lat_params = params.latency_only()
    for scenario in SCENARIOS:
        for design in DESIGNS:
            if not applies(design, scenario) or (design == "after-hier" and scenario != "allreduce_256MiB"):
                continue
            for n in ns:
                sim = run(design, scenario, n, params)
                results[(scenario, design, n)] = {"us": sim.time(), "lat": run(design, scenario, n, lat_params).time(),
                                                  "msgs": sim.max_msgs(), "bytes": sim.max_bytes()}
    return results


def targets(results, params, n=TARGET_N):
    """Issue 32's three targets, checked in the model at n ranks: [(label, value text, passed)]."""
    out = []
    cached = results[("cached", "after", n)]["lat"]
    out.append((f"cached round <= 12 latencies per rank (after, N={n})", f"{cached:.1f}", cached <= 12 + 1e-9))
    limit = 2 * math.log2(n)
    small = results[("allreduce_4B", "after", n)]["lat"]
    out.append((f"4 B allreduce <= 2 log2(N) = {limit:g} latencies (after, N={n})", f"{small:.1f}",
                small <= limit + 1e-9))
    bound = ring_bound_us(n, 256 * MiB, params)
    for design in ("after", "after-hier"):
        ratio = bound / results[("allreduce_256MiB", design, n)]["us"]
        out.append((f"256 MiB allreduce >= 0.9 x ring bandwidth bound ({design}, N={n})", f"{ratio:.3f}x",
                    ratio >= 0.9))
    return out


def table_lines(name, params, results, ns=NS):
    lines = [f"== {name}: alpha {params.alpha_us:g} us, o {params.o_us:g} us, beta {params.beta_ns_per_byte:g} ns/B "
             f"({1 / params.beta_ns_per_byte:.2f} GB/s), gamma {params.gamma_ns_per_byte:g} ns/B"
             + (f"; inside a host of {params.ranks_per_host}: alpha {params.local().alpha_us:g} us, "
                f"o {params.local().o_us:g} us, beta {params.local().beta_ns_per_byte:g} ns/B"
                if params.local() != params else "")]
    for scenario in SCENARIOS:
        designs = [d for d in DESIGNS if (scenario, d, ns[0]) in results]
        lines.append(f"\n{SCENARIO_TITLES[scenario]}: us | latencies (alpha units, no per-byte cost) | "
                     f"max messages sent per rank")
        lines.append("      N | " + " | ".join(f"{d:>27}" for d in designs))
        for n in ns:
            cells = []
            for d in designs:
                r = results[(scenario, d, n)]
                cells.append(f"{_fmt_us(r['us']):>11} {r['lat']:8.1f} {r['msgs']:6d}")
            lines.append(f"{n:7d} | " + " | ".join(cells))
        if scenario == "allreduce_256MiB":
            lines.append("  ring bandwidth bound 2(N-1)/N*S*beta, us: "
                         + ", ".join(f"N={n}: {_fmt_us(ring_bound_us(n, 256 * MiB, params))}" for n in ns))
    lines.append("")
    for label, value, ok in targets(results, params):
        lines.append(f"  target {label}: {value}  {'pass' if ok else 'MISS'}")
    return lines


def _fmt_us(us):
    return f"{us:.1f}" if us < 1e4 else f"{us:.4g}"


def write_csv(path, sets):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["params", "scenario", "design", "ranks", "time_us", "latencies", "max_msgs_per_rank",
                    "max_bytes_per_rank"])
        for name, (_, results) in sets.items():
            for (scenario, design, n), r in sorted(results.items()):
                w.writerow([name, scenario, design, n, f"{r['us']:.3f}", f"{r['lat']:.3f}", r["msgs"],
                            f"{r['bytes']:.0f}"])


def plot(path, sets, ns=NS):
    """One panel per scenario, time against N, one line per design and parameter set (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed in this Python, so no plot was written", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(5 * len(SCENARIOS), 4.2))
    for ax, scenario in zip(axes, SCENARIOS):
        for style, (name, (_, results)) in zip(("-", "--"), sets.items()):
            for design in DESIGNS:
                if (scenario, design, ns[0]) in results:
                    ax.plot(ns, [results[(scenario, design, n)]["us"] for n in ns], style, marker="o",
                            label=f"{design} ({name})")
        ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="us", title=SCENARIO_TITLES[scenario])
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def load_fit(path, transport="shm"):
    """THIS_MACHINE's parameters from benches/scale_fit.py's fit.json (one transport's)."""
    f = json.loads(Path(path).read_text())[transport]
    return Params(alpha_us=f["alpha_us"], o_us=f["o_us"], beta_ns_per_byte=f["beta_ns_per_byte"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/scale", help="folder for scale_model.csv and .png")
    p.add_argument("--params", default=None, help="fit.json from benches/scale_fit.py (default: the built-in fit)")
    p.add_argument("--transport", default="shm", help="which transport's fit to take from --params (shm, tcp)")
    p.add_argument("--gamma", type=float, default=0.0, help="per-byte reduce cost, ns/B, for both sets (default 0)")
    args = p.parse_args(argv)
    machine = load_fit(args.params, args.transport) if args.params else THIS_MACHINE
    sets = {"this-machine": replace(machine, gamma_ns_per_byte=args.gamma),
            "cluster-100G": replace(CLUSTER, gamma_ns_per_byte=args.gamma)}
    evaluated = {}
    for name, params in sets.items():
        results = evaluate(params)
        evaluated[name] = (params, results)
        print("\n".join(table_lines(name, params, results)) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "scale_model.csv", evaluated)
    wrote = [str(out / "scale_model.csv")]
    if plot(out / "scale_model.png", evaluated):
        wrote.append(str(out / "scale_model.png"))
    print(f"wrote {', '.join(wrote)}", file=sys.stderr)


if __name__ == "__main__":
    main()
