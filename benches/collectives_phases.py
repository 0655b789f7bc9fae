"""The measurement phases one rank runs, written against the backend interface of `collectives_backends`.

Each phase returns raw records `(op, size_bytes, metric, value)` for this rank only; turning them into
p50/p90, max-over-ranks times and bus bandwidths happens in `collectives_report`, so nothing is lost here.
Invariants: every rank runs the same calls in the same order (counts come from the plan, never from local
timings, or ranks would disagree and hang); warm-up calls and buffer first-touch are outside timed regions;
a barrier precedes every timed region.
"""

import math
import time

F32 = 4
# Upper bound on time-based warm-up steps (a fast step and a long warm-up time must not run forever).
MAX_WARMUP_STEPS = 1000


def _calls_for(size, plan):
    """Back-to-back calls in one timed batch: about `bw_budget_bytes` of payload, within [min, max]."""
    return max(plan["bw_min_calls"], min(plan["bw_max_calls"], plan["bw_budget_bytes"] // size))


def check_values(backend):
    """One real allreduce of known values, so a broken build cannot post fast numbers."""
    buf = backend.new_buffer(4)
    buf[:] = backend.rank + 1
    backend.allreduce_(buf, name="bench.check")
    expected = backend.size * (backend.size + 1) / 2
    if not all(float(v) == expected for v in buf):
        raise SystemExit(f"{backend.name}: allreduce check failed: got {list(buf)}, expected {expected}")


def latency(backend, plan):
    """p50/p90 material: one record per timed call. Allreduce at every latency size; a barrier, small in-place
    broadcasts and small allgathers (into new memory) where the plan asks; rvod also times `rvod.torch.allreduce`
    on torch tensors."""
    records = []
    ops = [("allreduce", plan["latency_sizes"], backend.new_buffer, backend.allreduce_latency)]
    if plan.get("barrier_latency"):
        ops.append(("barrier", [0], backend.new_buffer, lambda buf, name: backend.barrier()))
    if plan.get("broadcast_latency_sizes"):
        ops.append(("broadcast", plan["broadcast_latency_sizes"], backend.new_buffer, backend.broadcast_))
    if plan.get("allgather_latency_sizes"):
        ops.append(("allgather_small", plan["allgather_latency_sizes"], backend.new_buffer, backend.allgather_latency))
    if hasattr(backend, "torch_allreduce") and plan.get("rvod_torch_input_sizes"):
        import torch

        ops.append(("allreduce_torch_input", plan["rvod_torch_input_sizes"],
                    lambda count: torch.zeros(count, dtype=torch.float32), backend.torch_allreduce))
    for op, sizes, make, call in ops:
        for size in sizes:
            buf = make(max(1, size // F32))
            name = f"bench.lat.{op}.{size}"
            backend.barrier()
            for _ in range(plan["latency_warmup"]):
                call(buf, name)
            backend.barrier()
            clock = time.perf_counter_ns
            samples = []
            for _ in range(plan["latency_iters"]):
                t0 = clock()
                call(buf, name)
                samples.append(clock() - t0)
            records.extend((op, size, "call_us", ns / 1e3) for ns in samples)
    return records


def _arena_views(arena, size, plan):
    """`k` disjoint buffers of `size` bytes inside `arena`, with k * size >= the working set (>= 2 buffers)."""
    count = size // F32
    k = max(2, -(-plan["working_set_bytes"] // size))
    k = min(k, len(arena) // count)
    return [arena[i * count:(i + 1) * count] for i in range(k)]


def _timed_batch(backend, calls, one_call):
    backend.barrier()
    t0 = time.perf_counter()
    for i in range(calls):
        one_call(i)
    return (time.perf_counter() - t0) / calls


def bandwidth(backend, plan, arena):
    """Allreduce in place and out of place (a result in new memory, as each API gives it; the result is dropped
    at once, as a training step drops it), allgather and broadcast, rotating through buffers larger than the
    L3 cache."""
    records = []
    gather_out = {}
    for op, sizes in (("allreduce", plan["bw_sizes"]), ("allreduce_out_of_place", plan.get("out_of_place_sizes", [])),
                      ("allgather", plan["allgather_sizes"]), ("broadcast", plan["broadcast_sizes"])):
        for size in sizes:
            bufs = _arena_views(arena, size, plan)
            name = f"bench.bw.{op}.{size}"
            if op == "allreduce":
                def one_call(i, bufs=bufs, name=name):
                    backend.allreduce_(bufs[i % len(bufs)], name)
            elif op == "allreduce_out_of_place":
                def one_call(i, bufs=bufs, name=name):
                    backend.allreduce_out(bufs[i % len(bufs)], name)
            elif op == "broadcast":
                def one_call(i, bufs=bufs, name=name):
                    backend.broadcast_(bufs[i % len(bufs)], name)
            else:
                out = gather_out.setdefault(size, backend.new_buffer(backend.size * size // F32))

                def one_call(i, bufs=bufs, name=name, out=out):
                    backend.allgather(bufs[i % len(bufs)], out, name)
            for i in range(plan["bw_warmup"]):
                one_call(i)
            calls = _calls_for(size, plan)
            mean_s = _timed_batch(backend, calls, one_call)
            records.append((op, size, "batch_mean_s", mean_s))
            records.append((op, size, "calls", calls))
            records.append((op, size, "buffers", len(bufs)))
        gather_out.clear()
    return records


def _check_fused(backend, tensors, names, variant):
    """One fused step on known values (then back to zeros), so a way that drops tensors cannot post numbers."""
    for t in tensors:
        t[:] = backend.rank + 1
    backend.fused_step(tensors, names, variant)
    expected = backend.size * (backend.size + 1) / 2
    bad = [i for i, t in enumerate(tensors) if not (float(t.min()) == float(t.max()) == expected)]
    if bad:
        raise SystemExit(f"{backend.name}: fused {variant} check failed for {len(bad)} tensor(s), first {bad[0]}: "
                         f"got {float(tensors[bad[0]][0])}, expected {expected}")
    for t in tensors:
        t[:] = 0.0


def _warm_up(backend, plan, name, step):
    """Run `step` for about `fusion_warmup_s` seconds (at least `fusion_warmup` times), so each way is timed in
    steady state: right after a phase change, rvod's grouped step was seen to run 1.5-2x slower for 10-40
    steps (~20-60 ms) while the scheduler settled the ranks' threads on the cores, which one warm-up step of
    gloo's (~0.5 s) always covers and one of rvod's (~1 ms) does not. Rank 0's step count is broadcast, so
    every rank runs the same number of steps."""
    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    wanted = max(plan["fusion_warmup"], math.ceil(plan["fusion_warmup_s"] / max(first_s, 1e-6)))
    count = backend.new_buffer(1)
    count[0] = min(wanted, MAX_WARMUP_STEPS) - 1
    backend.broadcast_(count, name)
    for _ in range(int(count[0])):
        step()


def fusion(backend, plan):
    """Many small tensors per step (each of the backend's ways) vs one allreduce of the same total size."""
    records = []
    count, tensor_bytes = plan["fusion_count"], plan["fusion_tensor_bytes"]
    tensors = [backend.new_buffer(tensor_bytes // F32) for _ in range(count)]
    names = [f"bench.fusion.{i}" for i in range(count)]
    for variant in backend.fused_variants:
        _check_fused(backend, tensors, names, variant)
        _warm_up(backend, plan, f"bench.fusion.warmup.{variant}",
                 lambda variant=variant: backend.fused_step(tensors, names, variant))
        for _ in range(plan["fusion_steps"]):
            backend.barrier()
            t0 = time.perf_counter()
            submit_s = backend.fused_step(tensors, names, variant)
            records.append((f"fused_{variant}", count * tensor_bytes, "step_s", time.perf_counter() - t0))
            if submit_s is not None:
                records.append((f"fused_{variant}", count * tensor_bytes, "submit_s", submit_s))
    # The comparison point: one in-place allreduce of the same total size, same (hot) memory conditions.
    single = backend.new_buffer(count * tensor_bytes // F32)
    name = "bench.fusion.single"
    _warm_up(backend, plan, "bench.fusion.warmup.single", lambda: backend.allreduce_(single, name))
    mean_s = _timed_batch(backend, plan["fusion_single_calls"], lambda i: backend.allreduce_(single, name))
    records.append(("single_allreduce_hot", count * tensor_bytes, "batch_mean_s", mean_s))
    return records
