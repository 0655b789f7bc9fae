"""From the ranks' raw records to the numbers that are reported: per-round metrics, same-round speedups,
the stdout table, the CSV, the JSON summary and the PNG plot.

Conventions (../shared/reference/performance.md, as nccl-tests uses them): t = max over ranks of each rank's
mean over a batch of back-to-back calls; busbw = S/t x factor with factor 2(n-1)/n for allreduce, (n-1)/n for
allgather (S = the gathered output, n x the per-rank input) and 1 for broadcast. Latency p50/p90 are taken
per rank over its calls, then the max over ranks. "a vs b" speedups say how many times faster a is than b:
b's time / a's time, or a's busbw / b's busbw, computed within each round (a and b ran minutes apart at most)
and reported as the median of the per-round ratios with their min-max. The pairs compared: every
implementation vs gloo, rvod-shm vs rvod-tcp, and every rvod implementation vs horovod and vs MPI when they ran.
"""

import csv
import statistics
import sys
from collections import defaultdict

GB = 1e9
MiB = 1 << 20
TORCH_INPUT = "allreduce_torch_input"
# Sort order for implementations when the plan does not list them (results of older runs).
KNOWN_ORDER = ("rvod-shm", "rvod-tcp", "rvod", "horovod", "gloo", "mpi")
# How each way of running the many-small-tensors step is labelled in the table.
WAYS = {
    "fused_async_then_synchronize": "allreduce_async_ each, then synchronize",
    "fused_grouped": "grouped_allreduce_, one call",
    "fused_torch_async_then_synchronize": "rvod.torch allreduce_async_, synchronize",
    "fused_one_by_one": "all_reduce each, one by one",
    "fused_async_then_wait": "all_reduce(async_op=True) each, then wait",
    "fused_iallreduce_then_waitall": "Iallreduce each, then Waitall",
    "single_allreduce_hot": "reference: one {size} allreduce_",
}


def _percentile(sorted_values, q):
    """Nearest-rank percentile."""
    index = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def bus_factor(op, n):
    if op in ("allreduce", "allreduce_out_of_place") or op.startswith(("fused", "single_allreduce")):
        return 2 * (n - 1) / n
    if op == "allgather":
        return n - 1  # (n-1)/n of the n x S_in output
    return 1.0


def impl_order(docs, plan=None):
    """The implementations in the order each round ran them (the plan's), else a fixed order."""
    seen = {d["impl"] for d in docs}
    listed = [i for i in (plan or {}).get("impls", []) if i in seen]
    rest = sorted(seen - set(listed), key=lambda i: (KNOWN_ORDER.index(i) if i in KNOWN_ORDER else 99, i))
    return listed + rest


def comparisons(impls):
    """The (a, b) pairs reported as "a vs b" speedups."""
    pairs = [(a, "gloo") for a in impls if a != "gloo"] if "gloo" in impls else []
    if "rvod-shm" in impls and "rvod-tcp" in impls:
        pairs.append(("rvod-shm", "rvod-tcp"))
    for peer in ("horovod", "mpi"):
        if peer in impls:
            pairs += [(a, peer) for a in impls if a.startswith("rvod")]
    return pairs


def transports(docs):
    """What each implementation's jobs really ran over, as the workers saw it: {impl: "shm" or "a, b"}."""
    seen = defaultdict(set)
    for d in docs:
        seen[d["impl"]].add(str(d.get("transport", "?")))
    return {impl: ", ".join(sorted(kinds)) for impl, kinds in seen.items()}


def aggregate(raw_files):
    """Per-round metrics: {(impl, op, size, round): {metric: value}} plus the per-rank CSV rows."""
    rows = []
    per_rank = defaultdict(lambda: defaultdict(list))  # (impl, op, size, round, metric) -> rank -> values
    torch_native = set()
    n = None
    for doc in raw_files:
        n = doc["size"]
        if doc.get("tensors", "torch" if doc["impl"] == "gloo" else "numpy") == "torch":
            torch_native.add(doc["impl"])
        for op, size, metric, value in doc["records"]:
            rows.append((doc["impl"], op, size, doc["round"], metric, value, doc["rank"]))
            per_rank[(doc["impl"], op, size, doc["round"], metric)][doc["rank"]].append(value)
    metrics = defaultdict(dict)
    for (impl, op, size, rnd, metric), by_rank in per_rank.items():
        out = metrics[(impl, op, size, rnd)]
        if metric == "call_us":
            out["p50_us"] = max(_percentile(sorted(v), 50) for v in by_rank.values())
            out["p90_us"] = max(_percentile(sorted(v), 90) for v in by_rank.values())
            out["calls"] = min(len(v) for v in by_rank.values())
        elif metric in ("batch_mean_s", "step_s"):
            t = max(statistics.fmean(v) for v in by_rank.values())
            out["t_s"] = t
            payload = size * (n if op == "allgather" else 1)
            out["algbw_GBps"] = payload / t / GB
            out["busbw_GBps"] = size / t * bus_factor(op, n) / GB
        elif metric == "submit_s":
            out["submit_s"] = max(statistics.fmean(v) for v in by_rank.values())
        else:
            out[metric] = max(v[0] for v in by_rank.values())
    _add_fusion_metrics(metrics)
    _add_torch_native_latency(metrics, torch_native)
    for (impl, op, size, rnd), values in sorted(metrics.items(), key=lambda kv: tuple(map(str, kv[0]))):
        for metric, value in values.items():
            rows.append((impl, op, size, rnd, metric, value, ""))
    return n, metrics, rows


def _warmup_words(plan):
    if "fusion_warmup_s" in plan:  # runs before the warm-up became time-based have only a step count
        return f"warming up for {plan['fusion_warmup_s']:g} s, at least {plan['fusion_warmup']} step"
    return f"{plan['fusion_warmup']} warm-up"


def _add_fusion_metrics(metrics):
    """Per round: each fused way's busbw as a fraction of one allreduce of the same total size (same job), and
    "fused", the faster of the implementation's ways (`variant` says which)."""
    best = {}
    for (impl, op, size, rnd), values in metrics.items():
        if not op.startswith("fused_") or "t_s" not in values:
            continue
        single = metrics.get((impl, "single_allreduce_hot", size, rnd))
        if single and "busbw_GBps" in single:
            values["busbw_fraction"] = values["busbw_GBps"] / single["busbw_GBps"]
        current = best.get((impl, size, rnd))
        if current is None or values["t_s"] < current[1]["t_s"]:
            best[(impl, size, rnd)] = (op, values)
    for (impl, size, rnd), (op, values) in best.items():
        metrics[(impl, "fused", size, rnd)] = dict(values, variant=op[len("fused_"):])


def _add_torch_native_latency(metrics, torch_native):
    """gloo and Horovod take torch tensors in every call, so their small-allreduce latency is also their
    torch-tensor latency: copy it under TORCH_INPUT, beside rvod's rvod.torch figures, for the ratios."""
    sizes = {size for (_, op, size, _) in metrics if op == TORCH_INPUT}
    for (impl, op, size, rnd), values in list(metrics.items()):
        if impl in torch_native and op == "allreduce" and size in sizes and "p50_us" in values:
            metrics.setdefault((impl, TORCH_INPUT, size, rnd), dict(values, same_as="allreduce"))


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["impl", "op", "size_bytes", "round", "metric", "value", "rank"])
        w.writerows(rows)


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(metrics, rounds, impls):
    """{(op, size): {"impls": {impl: {metric: spread}}, "speedup": {"a vs b": {metric: spread}},
    "picked": {impl: "variant k/n, ..."}}} over the rounds."""
    summary = {}
    for op, size in {(op, size) for (_, op, size, _) in metrics}:
        entry = summary[(op, size)] = {"impls": {}, "speedup": {}, "picked": {}}
        for impl in impls:
            per_metric = defaultdict(list)
            picked = []
            for rnd in rounds:
                for metric, value in metrics.get((impl, op, size, rnd), {}).items():
                    if isinstance(value, (int, float)):
                        per_metric[metric].append(value)
                    elif metric == "variant":
                        picked.append(value)
            if per_metric:
                entry["impls"][impl] = {metric: _spread(values) for metric, values in per_metric.items()}
            if picked:
                entry["picked"][impl] = ", ".join(f"{v} {picked.count(v)}/{len(picked)}" for v in sorted(set(picked)))
        for a, b in comparisons(impls):
            ratios = defaultdict(list)
            for rnd in rounds:
                ma, mb = metrics.get((a, op, size, rnd)), metrics.get((b, op, size, rnd))
                for metric in ("p50_us", "p90_us", "t_s"):
                    if ma and mb and metric in ma and metric in mb and ma[metric] > 0:
                        ratios[metric].append(mb[metric] / ma[metric])
            if ratios:
                entry["speedup"][f"{a} vs {b}"] = {metric: _spread(values) for metric, values in ratios.items()}
    return summary


def human_size(size):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _scaled(spread, factor):
    return spread and {k: (v * factor if k in ("median", "min", "max") else v) for k, v in spread.items()}


def _fmt(spread, digits=2):
    """median [min-max] (just the median when there is one round)."""
    if not spread:
        return "-"
    m = f"{spread['median']:.{digits}f}"
    if spread["n"] > 1:
        return f"{m} [{spread['min']:.{digits}f}-{spread['max']:.{digits}f}]"
    return m


def _sizes(summary, op):
    return sorted(size for (o, size) in summary if o == op)


def _baselines(impls):
    out = []
    for _, b in comparisons(impls):
        if b not in out:
            out.append(b)
    return out


def _spreads(summary, op, size, impl):
    return summary.get((op, size), {}).get("impls", {}).get(impl, {})


def _get(summary, op, size, impl, metric):
    return _spreads(summary, op, size, impl).get(metric)


def _speedup(summary, op, size, pair, metric):
    return summary.get((op, size), {}).get("speedup", {}).get(pair, {}).get(metric)


def _impl_table(summary, op, impls, columns, ratio_metric, extra=None):
    """One row per (size, implementation): value columns [(header, metric, digits)], then the speedups
    of this row's implementation vs each baseline (`ratio_metric`), then `extra(spreads)` if given."""
    baselines = _baselines(impls)
    pairs = comparisons(impls)
    head = f"{'size':>8} | {'impl':<8} | " + " | ".join(f"{c[0]:>22}" for c in columns)
    head += "".join(f" | {'speedup vs ' + b:>22}" for b in baselines) + (f" | {extra[0]}" if extra else "")
    lines = [head]
    for size in _sizes(summary, op):
        first = True
        for impl in impls:
            spreads = _spreads(summary, op, size, impl)
            if columns[0][1] not in spreads:
                continue
            row = f"{human_size(size) if first else '':>8} | {impl:<8} | "
            row += " | ".join(f"{_fmt(spreads.get(m), d):>22}" for _, m, d in columns)
            for b in baselines:
                ratio = _speedup(summary, op, size, f"{impl} vs {b}", ratio_metric) if (impl, b) in pairs else None
                row += f" | {_fmt(ratio) if ratio else '':>22}"
            lines.append((row + (f" | {extra[1](spreads)}" if extra else "")).rstrip())
            first = False
    return lines


def table_lines(summary, n, plan, rounds, impls, seen_transports=None):
    """The stdout table; also reused verbatim in docs/performance.md."""
    nr = len(rounds)
    lines = [f"{n} ranks, {nr} round(s); each round runs {', '.join(impls)} in this order. Each cell: median over "
             f"rounds [min-max].",
             "\"speedup vs b\" = how many times faster the row's implementation is than b (b's time / its time, its "
             "busbw / b's busbw), the median of the per-round ratios [min-max]."]
    if seen_transports:
        lines.append("transports the jobs reported: " + ", ".join(f"{i} {seen_transports[i]}" for i in impls
                                                                    if i in seen_transports))
    lat = [("p50 us", "p50_us", 1), ("p90 us", "p90_us", 1)]
    lines += ["", f"allreduce latency, us per call ({plan['latency_iters']} calls per size per round after "
                  f"{plan['latency_warmup']} warm-up; rvod: rvod.numpy.allreduce(x, name=fixed, op=Sum); gloo: "
                  "dist.all_reduce; horovod: horovod.torch.allreduce; MPI: Allreduce(x, np.empty_like(x))); speedups of p50 "
                  "(p90's are in the JSON)"]
    lines += _impl_table(summary, "allreduce", impls, lat, "p50_us")
    for op, words in (("barrier", "barrier, us per call (rvod: hvd.barrier(); gloo: dist.barrier; MPI: Barrier)"),
                      ("broadcast", "broadcast in place from rank 0, us per call (rvod: hvd.broadcast_; gloo: "
                                    "dist.broadcast; MPI: Bcast)"),
                      ("allgather_small", "allgather, us per call (size = per-rank input; a result in new memory: "
                                          "rvod and horovod: hvd.allgather(x); gloo: all_gather_into_tensor into "
                                          "a new tensor; MPI: Allgather(x, np.empty(n x len)))")):
        if _sizes(summary, op) and any("p50_us" in s for size in _sizes(summary, op)
                                       for s in summary[(op, size)]["impls"].values()):
            lines += ["", words] + _impl_table(summary, op, impls, lat, "p50_us")
    if _sizes(summary, TORCH_INPUT):
        lines += ["", "allreduce of a torch tensor, us per call (rvod: rvod.torch.allreduce(t, name=fixed, op=Sum), "
                      "same calls and warm-up; gloo and horovod: their rows above, which are torch tensors already)"]
        lines += _impl_table(summary, TORCH_INPUT, impls, lat, "p50_us")
    bw = [("busbw GB/s", "busbw_GBps", 3)]
    calls = ("calls/batch", lambda s: int(s["calls"]["median"]) if "calls" in s else "-")
    titles = {
        "allreduce": (f"allreduce bus bandwidth, GB/s (in place; rotating buffers, >= "
                      f"{human_size(plan['working_set_bytes'])} working set, i.e. DRAM, not hot cache)"),
        "allreduce_out_of_place": ("allreduce bus bandwidth out of place, GB/s (a result in new memory: rvod and "
                                   "horovod allreduce(x), gloo all_reduce(x.clone()), MPI Allreduce(x, "
                                   "np.empty_like(x)); same rotating buffers)"),
        "allgather": ("allgather bus bandwidth, GB/s (size = per-rank input; busbw = (n-1) x input / t; rvod and "
                      "horovod return a new tensor, gloo all_gather_into_tensor fills a preallocated one)"),
        "broadcast": "broadcast bus bandwidth, GB/s (in place, root 0)",
    }
    for op, title in titles.items():
        if _sizes(summary, op) and any("busbw_GBps" in s for size in _sizes(summary, op)
                                       for s in summary[(op, size)]["impls"].values()):
            lines += ["", title] + _impl_table(summary, op, impls, bw, "t_s", calls)
    for size in _sizes(summary, "fused"):
        lines += [""] + _fusion_lines(summary, plan, size, impls)
    return lines


def _fusion_lines(summary, plan, size, impls):
    count = plan["fusion_count"]
    lines = [f"fused small tensors: {count} x {human_size(plan['fusion_tensor_bytes'])} float32 per step "
             f"({plan['fusion_steps']} steps per round after {_warmup_words(plan)}); fraction = the step's "
             f"busbw / the busbw of one {human_size(size)} in-place allreduce of a hot buffer in the same job",
             f"{'impl':<8} | {'way':<42} | {'ms per step':>22} | {'busbw GB/s':>22} | {'fraction':>22} | submit ms"]
    ways = sorted({op for (op, sz) in summary if sz == size and op.startswith("fused_")},
                  key=lambda op: list(WAYS).index(op) if op in WAYS else 99) + ["single_allreduce_hot"]
    for impl in impls:
        for op in ways:
            s = _spreads(summary, op, size, impl)
            if "t_s" not in s:
                continue
            label = WAYS.get(op, op).format(size=human_size(size))
            lines.append(f"{impl:<8} | {label:<42} | {_fmt(_scaled(s['t_s'], 1e3), 1):>22} | "
                         f"{_fmt(s.get('busbw_GBps'), 3):>22} | {_fmt(s.get('busbw_fraction')):>22} | "
                         f"{_fmt(_scaled(s.get('submit_s'), 1e3), 1)}")
    fused = summary[("fused", size)]
    lines.append("  speedup per step, each implementation's faster way in each round (" +
                 "; ".join(f"{i}: {p}" for i, p in fused["picked"].items()) + "):")
    lines.append("    " + "; ".join(f"{pair} {_fmt(sp.get('t_s'))}"
                                                    for pair, sp in fused["speedup"].items()))
    return lines


def _verdict(spread, threshold, at_most=False, unit=""):
    if not spread:
        return "not measured"
    med = spread["median"]
    ok = med <= threshold if at_most else med >= threshold
    tag = "MET" if ok else "NOT MET"
    if ok and (spread["max"] > threshold if at_most else spread["min"] < threshold):
        tag += " (but not in every round)"
    return f"{tag}: {_fmt(spread)}{unit}"


def target_lines(summary, plan):
    """The issue's targets, read from this run (same-run ratios; the one absolute figure is the 20 us)."""
    lines = [f"target: rvod-shm 4 B allreduce through rvod.torch p50 <= 20 us: "
             f"{_verdict(_get(summary, TORCH_INPUT, 4, 'rvod-shm', 'p50_us'), 20.0, at_most=True, unit=' us')}"]
    for impl in ("rvod-shm", "rvod-tcp"):
        lines.append(f"target: {impl} 4 B allreduce through rvod.torch p50 <= 1/5 of gloo's (speedup >= 5): "
                     f"{_verdict(_speedup(summary, TORCH_INPUT, 4, f'{impl} vs gloo', 'p50_us'), 5.0)}")
    for impl, x in (("rvod-shm", 4.0), ("rvod-tcp", 1.5)):
        lines.append(f"target: {impl} 64 MiB allreduce busbw >= {x:g}x gloo's: "
                     f"{_verdict(_speedup(summary, 'allreduce', 64 * MiB, f'{impl} vs gloo', 't_s'), x)}")
    for size in _sizes(summary, "fused"):
        ways = {op: _get(summary, op, size, "rvod-shm", "busbw_fraction") for (op, sz) in summary
                if sz == size and op.startswith("fused_")}
        ways = {op: s for op, s in ways.items() if s}
        if not ways:
            lines.append(f"target: rvod-shm fused busbw >= 80% of one {human_size(size)} allreduce's: not measured")
            continue
        best = max(ways, key=lambda op: ways[op]["median"])
        others = "; ".join(f"{WAYS.get(op, op)}: {_fmt(s)}" for op, s in ways.items() if op != best)
        lines.append(f"target: rvod-shm {plan['fusion_count']} x {human_size(plan['fusion_tensor_bytes'])} fused busbw "
                     f">= 80% of one {human_size(size)} allreduce's, better way ({WAYS.get(best, best)}): "
                     f"{_verdict(ways[best], 0.8)}" + (f" (other way: {others})" if others else ""))
    return lines


def _inverse(spread):
    """How many times slower, from a "how many times faster" spread."""
    if not spread:
        return None
    return {"median": 1 / spread["median"], "min": 1 / spread["max"], "max": 1 / spread["min"], "n": spread["n"]}


def _ratio(a, b):
    """a's median / b's median as a spread of one (different jobs: only medians compare)."""
    if not a or not b or not b["median"]:
        return None
    return {"median": a["median"] / b["median"], "min": a["median"] / b["median"],
            "max": a["median"] / b["median"], "n": 1}


def mpi_target_lines(summary, plan):
    """Issue 19's targets against MPI (same-run ratios; "x MPI's" = rvod's time / MPI's time)."""
    lines = []
    for label, op, size in (("4 B allreduce through rvod.numpy", "allreduce", 4), ("barrier", "barrier", 0),
                            ("8 B broadcast", "broadcast", 8)):
        slower = _inverse(_speedup(summary, op, size, "rvod-shm vs mpi", "p50_us"))
        lines.append(f"target: rvod-shm {label} p50 <= 2x MPI's: {_verdict(slower, 2.0, at_most=True, unit='x')}")
    torch4 = _ratio(_get(summary, TORCH_INPUT, 4, "rvod-shm", "p50_us"), _get(summary, "allreduce", 4, "mpi", "p50_us"))
    lines.append("target: rvod-shm 4 B allreduce through rvod.torch p50 <= 3x MPI's (medians): "
                 f"{_verdict(torch4, 3.0, at_most=True, unit='x')}")
    burst_bytes = plan["fusion_count"] * plan["fusion_tensor_bytes"]
    mpi_burst = _get(summary, "fused_iallreduce_then_waitall", burst_bytes, "mpi", "t_s")
    for shim, way in (("rvod.torch", "fused_torch_async_then_synchronize"), ("rvod.numpy", "fused_async_then_synchronize")):
        burst = _ratio(_get(summary, way, burst_bytes, "rvod-shm", "t_s"), mpi_burst)
        lines.append(f"target: rvod-shm {plan['fusion_count']} x {human_size(plan['fusion_tensor_bytes'])} "
                     f"allreduce_async_ + synchronize ({shim}) <= MPI's Iallreduce + Waitall (medians): "
                     f"{_verdict(burst, 1.0, at_most=True, unit='x')}")
    lines.append(f"target: rvod-shm 64 MiB in-place allreduce busbw >= 3x MPI's: "
                 f"{_verdict(_speedup(summary, 'allreduce', 64 * MiB, 'rvod-shm vs mpi', 't_s'), 3.0)}")
    for impl in ("rvod-shm", "mpi"):
        oop = _ratio(_get(summary, "allreduce_out_of_place", 64 * MiB, impl, "t_s"),
                     _get(summary, "allreduce", 64 * MiB, impl, "t_s"))
        target = "target: " if impl == "rvod-shm" else "for comparison: "
        lines.append(f"{target}{impl} 64 MiB out-of-place time <= 1.3x its in-place time (medians): "
                     f"{_verdict(oop, 1.3, at_most=True, unit='x')}")
    return lines


def _impl_rank(label, impls):
    first = label.split()[0]
    return impls.index(first) if first in impls else len(impls)


def plot(path, summary, n, impls):
    """The PNG; where matplotlib is not installed, a line on stderr instead (the table, CSV and JSON are written
    already, and `--report-only` makes the plot later)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not importable: no plot ({path}); pip install matplotlib, then --report-only",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(13, 5))
    palette = {"rvod-shm": "tab:red", "rvod-tcp": "tab:orange", "rvod": "tab:red", "gloo": "tab:blue",
               "horovod": "tab:green", "mpi": "tab:purple"}
    for impl in impls:
        color = palette.get(impl)
        for ax, metric, label in ((bw_ax, "busbw_GBps", impl), (lat_ax, "p50_us", f"{impl} p50")):
            sizes = [sz for sz in _sizes(summary, "allreduce") if _get(summary, "allreduce", sz, impl, metric)]
            if not sizes:
                continue
            spreads = [_get(summary, "allreduce", sz, impl, metric) for sz in sizes]
            med = [s["median"] for s in spreads]
            err = [[m - s["min"] for m, s in zip(med, spreads)], [s["max"] - m for m, s in zip(med, spreads)]]
            line = ax.errorbar(sizes, med, yerr=err, marker="o", capsize=3, color=color, label=label)
            color = line[0].get_color()
            if metric == "p50_us":
                p90 = [_get(summary, "allreduce", sz, impl, "p90_us")["median"] for sz in sizes]
                ax.plot(sizes, p90, linestyle=":", color=color, label=f"{impl} p90")
        torch4 = _get(summary, TORCH_INPUT, 4, impl, "p50_us") if impl.startswith("rvod") else None
        if torch4:
            lat_ax.plot([4], [torch4["median"]], marker="*", markersize=12, linestyle="none", color=color,
                        label=f"{impl} p50, torch tensor via rvod.torch")
    lat_ax.axhline(20, color="grey", linestyle="--", linewidth=1, label="target: rvod-shm rvod.torch 4 B p50 20 us")
    bw_ax.set(xlabel="bytes per rank", ylabel="bus bandwidth, GB/s",
              title=f"allreduce bus bandwidth, {n} ranks (median, min-max over rounds)")
    lat_ax.set(xlabel="bytes per rank", ylabel="latency per call, us", title=f"allreduce latency, {n} ranks")
    for ax in (bw_ax, lat_ax):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_size(round(x)).replace(" ", "")))
        ax.grid(True, which="both", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            order = sorted(range(len(labels)), key=lambda i: (_impl_rank(labels[i], impls), labels[i]))
            ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
