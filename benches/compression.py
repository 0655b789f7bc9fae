"""Gradient compression across a 1 Gbit/s link (issue 34, item 5): rvod.torch's DistributedOptimizer with
Compression.none / int8 / onebit / powersgd(rank=4) against torch DDP over gloo with and without torch's
PowerSGD communication hook (matrix_approximation_rank=4, start_powerSGD_iter=2), on two shaped hosts.

    python benches/compression.py --out bench-compression/ [--per-host 1] [--rate 1gbit] [--rounds 3]

Needs root. The hosts are the namespaces of benches/hosts_allreduce.py (198.51.100.0/24, a veth pair shaped
with tc tbf each way, deleted whatever happens) with --per-host ranks in each; every rank holds an rvod
engine and a gloo process group (benches/compression_worker.py), and one job runs every round, the
contenders in turn inside it (A B C ... A B C ...), each training each model from the same initial weights
on the same shards of the digits data (a seed per round, so the rounds' accuracies are runs of their own): the 4 x 1024 MLP of benches/torch_training.py (communication-bound:
2.2 M parameters, 8.3 MiB of gradients a step) and examples/torch_digits.py's DigitsNet (38 K parameters).

Measured per model, contender and round: seconds per step (the slower rank's, after a few untimed steps),
the ranks' CPU time per step (every thread, summed over ranks) and the share of the cores it fills, bytes on the link per step (tx + rx of the first host's veth, headers included) and test accuracy after a
fixed number of epochs. Reported: medians [min-max] over rounds, and the medians of per-round ratios: rvod
powersgd(4) against rvod uncompressed (target >= 3x on the MLP) and against DDP with its PowerSGD hook
(target >= 1.3x), accuracy against uncompressed (target: within 0.5 points). Writes compression.jsonl
(the raw results) and compression.txt.
"""

import argparse
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hosts_allreduce as shaped  # noqa: E402

WORKER = Path(__file__).resolve().parent / "compression_worker.py"
CONTENDERS = ["rvod-none", "rvod-int8", "rvod-onebit", "rvod-powersgd4", "ddp", "ddp-powersgd4"]
# Not run unless named: every rank trains its own model, nothing sent (the step's computation alone: the floor
# under every contender's step, and so the most any compressor could gain on this machine).
LOCAL = "local"
MODELS = ["mlp", "digits-cnn"]
shaped.RVOD_SETTINGS["compression"] = {}


def run_all(args):
    plan = {"models": args.models.split(","), "contenders": args.contenders.split(","), "rounds": args.rounds,
            "epochs": {"mlp": args.mlp_epochs, "digits-cnn": args.cnn_epochs}, "warmup": args.warmup,
            "batch_size": args.batch_size, "lr": args.lr, "mlp_width": args.mlp_width, "powersgd_rank": 4}
    secret = secrets.token_bytes(16)
    with shaped.Hosts(args.rate) as hosts:
        store, port = shaped.start_store(hosts, secret)
        try:
            envs = shaped.rank_envs("compression", port, secret, hosts, per_host=args.per_host,
                                    gloo_port=shaped.gloo_store_port())
            out = shaped.launch(hosts, envs, [str(WORKER), json.dumps(plan)], args.out, "compression",
                                timeout=args.timeout)
        finally:
            store.kill()
            store.wait()
    return [dict(json.loads(line), rate=args.rate, per_host=args.per_host)
            for line in out.splitlines() if line.startswith("{")]


def spread(values, fmt):
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def cpu_use(runs):
    """The ranks' CPU time per step (all their threads, summed over ranks) and the share of the machine's cores
    it fills in the step's time: near 100%, the step is bound by the CPU, not the link (on this machine every
    namespace host shares the same cores)."""
    if any("cpu_seconds_per_step" not in r for r in runs):
        return ""  # results written before the benchmark measured it
    busy = [r["cpu_seconds_per_step"] / (r["cores"] * r["seconds_per_step"]) * 100 for r in runs]
    return (f", CPU {spread([r['cpu_seconds_per_step'] * 1e3 for r in runs], '{:.1f}')} ms/step "
            f"({spread(busy, '{:.0f}')}% of {runs[0]['cores']} cores)")


def report(results):
    rate, per_host = results[0]["rate"], results[0]["per_host"]
    by = {}
    for r in results:
        by.setdefault((r["model"], r["contender"]), []).append(r)
    rounds = max(r["round"] for r in results) + 1
    lines = [f"link {rate} each way, 2 hosts x {per_host} rank(s), {rounds} round(s); medians [min-max] over rounds; "
             "ratios are medians of per-round ratios (> 1: the first is faster)"]
    for model in dict.fromkeys(r["model"] for r in results):
        contenders = [c for (m, c) in by if m == model]
        lines.append(f"{model}:")
        for c in contenders:
            runs = by[(model, c)]
            lines.append(f"  {c:15} step {spread([r['seconds_per_step'] * 1e3 for r in runs], '{:.1f}')} ms, "
                         f"wire {spread([r['wire_bytes_per_step'] / 1e6 for r in runs], '{:.3f}')} MB/step, "
                         f"accuracy {spread([r['accuracy'] * 100 for r in runs], '{:.2f}')} %{cpu_use(runs)}")

        def ratio(a, b):
            """Median over rounds of b's step time / a's: how many times faster a is."""
            if (model, a) not in by or (model, b) not in by:
                return None
            pairs = zip(by[(model, a)], by[(model, b)])
            return statistics.median(rb["seconds_per_step"] / ra["seconds_per_step"] for ra, rb in pairs)

        def accuracy_gap(a, b):
            return statistics.median(ra["accuracy"] * 100 - rb["accuracy"] * 100
                                     for ra, rb in zip(by[(model, a)], by[(model, b)]))

        # The 3x is the target on the communication-bound MLP; the CNN's step is mostly compute.
        for a, b, target in (("rvod-powersgd4", "rvod-none", 3.0 if model == "mlp" else None),
                             ("rvod-powersgd4", "ddp-powersgd4", 1.3),
                             ("rvod-int8", "rvod-none", None), ("rvod-onebit", "rvod-none", None),
                             ("rvod-none", "ddp", None), ("ddp-powersgd4", "ddp", None)):
            value = ratio(a, b)
            if value is not None:
                goal = f" (target >= {target}x: {'met' if value >= target else 'missed'})" if target else ""
                lines.append(f"  {a} vs {b}: {value:.2f}x faster{goal}")
        floor = ratio("local", "rvod-none")
        if floor is not None:
            lines.append(f"  the computation alone ({LOCAL}) is {floor:.2f}x faster than rvod-none: no compressor can "
                         "gain more than that here")
        for c, base in [(c, "rvod-none") for c in contenders if c.startswith("rvod-") and c != "rvod-none"] + \
                       [("ddp-powersgd4", "ddp")]:
            if (model, c) in by and (model, base) in by:
                gap = accuracy_gap(c, base)
                lines.append(f"  accuracy {c} - {base}: {gap:+.2f} points "
                             f"(target within 0.5: {'met' if abs(gap) <= 0.5 else 'missed'})")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--per-host", type=int, default=1, help="ranks in each of the two hosts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated, of {', '.join(CONTENDERS)} and {LOCAL} (the computation alone)")
    parser.add_argument("--mlp-epochs", type=int, default=12,
                        help="12: where uncompressed training has converged (98%% test accuracy; 89%% after 3)")
    parser.add_argument("--cnn-epochs", type=int, default=8)
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps before the timed ones")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for the whole job")
    parser.add_argument("--setting", action="append", default=[], metavar="RVOD_NAME=VALUE",
                        help="an rvod setting for every rank (repeatable), e.g. RVOD_COMPRESSION_WARMUP_STEPS=60")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from --out's JSONL")
    args = parser.parse_args()
    for setting in args.setting:
        name, _, value = setting.partition("=")
        shaped.RVOD_SETTINGS["compression"][name] = value
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "compression.jsonl"
    if args.report_only:
        results = [json.loads(line) for line in raw.read_text().splitlines()]
    else:
        started = time.monotonic()
        results = run_all(args)
        raw.write_text("".join(json.dumps(r) + "\n" for r in results))
        print(f"ran in {time.monotonic() - started:.0f} s", flush=True)
    lines = report(results)
    print("\n".join(lines), flush=True)
    (args.out / "compression.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
