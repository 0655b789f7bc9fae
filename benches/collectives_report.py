"""From the ranks' raw records to the numbers that are reported: per-round metrics, rvod-vs-gloo ratios,
the stdout table, the CSV, the JSON summary and the PNG plot.

Conventions (../shared/reference/performance.md, as nccl-tests uses them): t = max over ranks of each rank's
mean over a batch of back-to-back calls; busbw = S/t x factor with factor 2(n-1)/n for allreduce, (n-1)/n for
allgather (S = the gathered output, n x the per-rank input) and 1 for broadcast. Latency p50/p90 are taken
per rank over its calls, then the max over ranks. "speedup" always means how many times faster rvod is:
gloo time / rvod time, or rvod busbw / gloo busbw. Each round pairs one rvod job with one gloo job; the
reported speedup is the median of the per-round speedups, with their min-max.
"""

import csv
import statistics
from collections import defaultdict

GB = 1e9


def _percentile(sorted_values, q):
    """Nearest-rank percentile."""
    index = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def bus_factor(op, n):
    if op == "allreduce" or op.startswith(("fused", "single_allreduce")):
        return 2 * (n - 1) / n
    if op == "allgather":
        return n - 1  # (n-1)/n of the n x S_in output
    return 1.0


def aggregate(raw_files):
    """Per-round metrics: {(impl, op, size, round): {metric: value}} plus the per-rank CSV rows."""
    rows = []
    per_rank = defaultdict(lambda: defaultdict(list))  # (impl, op, size, round, metric) -> rank -> values
    n = None
    for doc in raw_files:
        n = doc["size"]
        for op, size, metric, value in doc["records"]:
            rows.append((doc["impl"], op, size, doc["round"], metric, value, doc["rank"]))
            per_rank[(doc["impl"], op, size, doc["round"], metric)][doc["rank"]].append(value)
    metrics = defaultdict(dict)
    for (impl, op, size, rnd, metric), by_rank in per_rank.items():
        key = (impl, op, size, rnd)
        out = metrics[key]
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
    _add_best_gloo_fused(metrics)
    for (impl, op, size, rnd), values in sorted(metrics.items(), key=lambda kv: tuple(map(str, kv[0]))):
        for metric, value in values.items():
            rows.append((impl, op, size, rnd, metric, value, ""))
    return n, metrics, rows


def _add_best_gloo_fused(metrics):
    """gloo's fused figure is the faster of its two ways (one by one, or async_op=True then wait all), per round."""
    best = {}
    for (impl, op, size, rnd), values in metrics.items():
        if impl == "gloo" and op.startswith("fused_") and "t_s" in values:
            current = best.get((size, rnd))
            if current is None or values["t_s"] < current[1]["t_s"]:
                best[(size, rnd)] = (op, values)
    for (size, rnd), (op, values) in best.items():
        metrics[("gloo", "fused", size, rnd)] = dict(values, variant=op[len("fused_"):])
    for (impl, op, size, rnd), values in list(metrics.items()):
        if impl == "rvod" and op.startswith("fused_"):
            metrics[("rvod", "fused", size, rnd)] = dict(values, variant=op[len("fused_"):])


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["impl", "op", "size_bytes", "round", "metric", "value", "rank"])
        w.writerows(rows)


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(metrics, rounds):
    """{(op, size): {"rvod": {metric: spread}, "gloo": ..., "speedup": {metric: spread}}} over the rounds."""
    summary = defaultdict(lambda: defaultdict(dict))
    keys = {(op, size) for (_, op, size, _) in metrics}
    for op, size in keys:
        for impl in ("rvod", "gloo"):
            per_metric = defaultdict(list)
            for rnd in rounds:
                for metric, value in metrics.get((impl, op, size, rnd), {}).items():
                    if isinstance(value, (int, float)):
                        per_metric[metric].append(value)
            for metric, values in per_metric.items():
                summary[(op, size)][impl][metric] = _spread(values)
        ratios = defaultdict(list)
        for rnd in rounds:
            r, g = metrics.get(("rvod", op, size, rnd)), metrics.get(("gloo", op, size, rnd))
            if not r or not g:
                continue
            for metric in ("p50_us", "p90_us", "t_s"):
                if metric in r and metric in g and r[metric] > 0:
                    ratios[metric].append(g[metric] / r[metric])
        for metric, values in ratios.items():
            summary[(op, size)]["speedup"][metric] = _spread(values)
    # Fused many-small-tensors vs one tensor of the same total size, per implementation and round.
    for (op, size) in list(keys):
        if op != "fused":
            continue
        picked = [metrics[("gloo", "fused", size, rnd)]["variant"] for rnd in rounds
                  if ("gloo", "fused", size, rnd) in metrics]
        summary[(op, size)]["gloo_variants"] = ", ".join(f"{v} {picked.count(v)}/{len(picked)}"
                                                         for v in sorted(set(picked)))
        for impl in ("rvod", "gloo"):
            values = []
            for rnd in rounds:
                f = metrics.get((impl, "fused", size, rnd))
                s = metrics.get((impl, "single_allreduce_hot", size, rnd))
                if f and s:
                    values.append(f["busbw_GBps"] / s["busbw_GBps"])
            if values:
                summary[("fused_vs_single", size)][impl]["busbw_fraction"] = _spread(values)
    return summary


def human_size(size):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _fmt(spread, digits=2, with_range=True):
    if not spread:
        return "-"
    m = f"{spread['median']:.{digits}f}"
    if with_range and spread["n"] > 1:
        return f"{m} [{spread['min']:.{digits}f}-{spread['max']:.{digits}f}]"
    return m


def _sizes(summary, op):
    return sorted(size for (o, size) in summary if o == op)


def table_lines(summary, n, plan, rounds):
    """The stdout table; also reused verbatim in docs/performance.md."""
    lines = []
    nr = len(rounds)
    lines.append(f"{n} ranks, {nr} round(s), rvod and gloo alternating (A B A B ...). Each cell: median over rounds "
                 f"[min-max]. speedup = how many times faster rvod is (gloo time / rvod time, rvod busbw / gloo busbw),")
    lines.append("the median of the per-round ratios [min-max].")
    lat = _sizes(summary, "allreduce_torch_input")
    lines.append("")
    lines.append(f"allreduce latency, us per call ({plan['latency_iters']} calls per size per round after "
                 f"{plan['latency_warmup']} warm-up; rvod: rvod.numpy.allreduce(x, name=fixed, op=Sum); gloo: dist.all_reduce)")
    lines.append(f"{'size':>8} | {'rvod p50':>8} {'rvod p90':>8} | {'gloo p50':>8} {'gloo p90':>8} | "
                 f"{'speedup p50':>22} | {'speedup p90':>22}")
    for size in _sizes(summary, "allreduce"):
        s = summary[("allreduce", size)]
        if "p50_us" not in s["rvod"] and "p50_us" not in s["gloo"]:
            continue
        lines.append(f"{human_size(size):>8} | {_fmt(s['rvod'].get('p50_us'), 1, False):>8} "
                     f"{_fmt(s['rvod'].get('p90_us'), 1, False):>8} | {_fmt(s['gloo'].get('p50_us'), 1, False):>8} "
                     f"{_fmt(s['gloo'].get('p90_us'), 1, False):>8} | {_fmt(s['speedup'].get('p50_us')):>22} | "
                     f"{_fmt(s['speedup'].get('p90_us')):>22}")
    for size in lat:
        s = summary[("allreduce_torch_input", size)]
        g = summary.get(("allreduce", size), {}).get("gloo", {})
        lines.append(f"rvod given a torch tensor ({human_size(size)}): p50 {_fmt(s['rvod'].get('p50_us'), 1, False)} us, "
                     f"p90 {_fmt(s['rvod'].get('p90_us'), 1, False)} us (gloo p50 {_fmt(g.get('p50_us'), 1, False)} us)")
    for op, title in (("allreduce", ("allreduce bus bandwidth, GB/s (in place; rotating buffers, >= "
                                     f"{human_size(plan['working_set_bytes'])} working set, i.e. DRAM, not hot cache)")),
                      ("allgather", ("allgather bus bandwidth, GB/s (size = per-rank input; busbw = (n-1) x input / t; "
                                     "rvod returns a new array, gloo all_gather_into_tensor into a preallocated one)")),
                      ("broadcast", "broadcast bus bandwidth, GB/s (in place, root 0)")):
        sizes = [sz for sz in _sizes(summary, op) if "busbw_GBps" in summary[(op, sz)]["rvod"]
                 or "busbw_GBps" in summary[(op, sz)]["gloo"]]
        if not sizes:
            continue
        lines.append("")
        lines.append(title)
        lines.append(f"{'size':>8} | {'rvod busbw':>10} | {'gloo busbw':>10} | {'speedup':>22} | calls/batch")
        for size in sizes:
            s = summary[(op, size)]
            calls = s["rvod"].get("calls") or s["gloo"].get("calls")
            lines.append(f"{human_size(size):>8} | {_fmt(s['rvod'].get('busbw_GBps'), 3, False):>10} | "
                         f"{_fmt(s['gloo'].get('busbw_GBps'), 3, False):>10} | {_fmt(s['speedup'].get('t_s')):>22} | "
                         f"{int(calls['median']) if calls else '-'}")
    for size in _sizes(summary, "fused"):
        s = summary[("fused", size)]
        single = summary.get(("single_allreduce_hot", size), {})
        frac = summary.get(("fused_vs_single", size), {})
        count = plan["fusion_count"]
        lines.append("")
        lines.append(f"fused small tensors: {count} x {human_size(plan['fusion_tensor_bytes'])} float32 per step "
                     f"({plan['fusion_steps']} steps per round after {plan['fusion_warmup']} warm-up)")
        lines.append(f"  time per step, ms: rvod {_ms(s['rvod'].get('t_s'))}  gloo {_ms(s['gloo'].get('t_s'))}  "
                     f"speedup {_fmt(s['speedup'].get('t_s'))}")
        variants = "; ".join(f"{op[len('fused_'):]} {_ms(summary[(op, size)]['gloo'].get('t_s'))} ms"
                             for op in ("fused_one_by_one", "fused_async_then_wait") if (op, size) in summary)
        lines.append(f"  gloo is given the faster of its two ways each round (picked: {s.get('gloo_variants') or '-'}); "
                     f"medians: {variants}")
        submit = s["rvod"].get("submit_s")
        if submit:
            lines.append(f"  rvod: of which submitting the {count} allreduce_async_ calls: {_ms(submit)} ms "
                         f"({submit['median'] / count * 1e6:.1f} us per call)")
        for impl in ("rvod", "gloo"):
            lines.append(f"  {impl}: fused busbw {_fmt(s[impl].get('busbw_GBps'), 3, False)} GB/s vs one "
                         f"{human_size(size)} allreduce (same hot buffer) {_fmt(single.get(impl, {}).get('busbw_GBps'), 3, False)}"
                         f" GB/s: fraction {_fmt(frac.get(impl, {}).get('busbw_fraction'))}")
    return lines


def _ms(spread):
    if not spread:
        return "-"
    return _fmt({k: (v * 1e3 if k in ("median", "min", "max") else v) for k, v in spread.items()}, 1, False)


def target_lines(summary):
    """The issue's targets, read from this run."""
    lines = []

    def verdict(spread, threshold):
        if not spread:
            return "not measured"
        med = spread["median"]
        tag = "MET" if med >= threshold else "NOT MET"
        if spread["min"] < threshold <= med:
            tag += " (but not in every round)"
        return f"{tag}: {_fmt(spread)}"

    lat = summary.get(("allreduce", 4), {}).get("speedup", {}).get("p50_us")
    lines.append(f"target: allreduce 4 B p50 <= 1/5 of gloo's (speedup >= 5): {verdict(lat, 5.0)}")
    bw = summary.get(("allreduce", 64 << 20), {}).get("speedup", {}).get("t_s")
    lines.append(f"target: allreduce 64 MiB busbw >= 1.5x gloo's (speedup >= 1.5): {verdict(bw, 1.5)}")
    for (op, size), s in summary.items():
        if op == "fused_vs_single" and "busbw_fraction" in s.get("rvod", {}):
            lines.append(f"target: fused {human_size(size)} reaches >= 80% of one {human_size(size)} allreduce's "
                         f"busbw (rvod): {verdict(s['rvod']['busbw_fraction'], 0.8)}")
    return lines


def plot(path, summary, n):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"rvod": "tab:red", "gloo": "tab:blue"}
    for impl in ("rvod", "gloo"):
        sizes = [sz for sz in _sizes(summary, "allreduce") if "busbw_GBps" in summary[("allreduce", sz)][impl]]
        if sizes:
            spreads = [summary[("allreduce", sz)][impl]["busbw_GBps"] for sz in sizes]
            med = [s["median"] for s in spreads]
            err = [[m - s["min"] for m, s in zip(med, spreads)], [s["max"] - m for m, s in zip(med, spreads)]]
            bw_ax.errorbar(sizes, med, yerr=err, marker="o", capsize=3, color=colors[impl], label=f"{impl} allreduce")
        sizes = [sz for sz in _sizes(summary, "allreduce") if "p50_us" in summary[("allreduce", sz)][impl]]
        if sizes:
            spreads = [summary[("allreduce", sz)][impl]["p50_us"] for sz in sizes]
            med = [s["median"] for s in spreads]
            err = [[m - s["min"] for m, s in zip(med, spreads)], [s["max"] - m for m, s in zip(med, spreads)]]
            lat_ax.errorbar(sizes, med, yerr=err, marker="o", capsize=3, color=colors[impl], label=f"{impl} p50")
            p90 = [summary[("allreduce", sz)][impl]["p90_us"]["median"] for sz in sizes]
            lat_ax.plot(sizes, p90, linestyle=":", color=colors[impl], label=f"{impl} p90")
    bw_ax.set(xscale="log", xlabel="bytes per rank", ylabel="bus bandwidth, GB/s",
              title=f"allreduce bus bandwidth, {n} ranks (median, min-max over rounds)")
    lat_ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="latency per call, us",
               title=f"allreduce latency, {n} ranks")
    from matplotlib.ticker import FuncFormatter

    for ax in (bw_ax, lat_ax):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_size(round(x)).replace(" ", "")))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
