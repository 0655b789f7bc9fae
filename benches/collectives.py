"""rvod's collective benchmark: rvod over shared memory, rvod over TCP, torch.distributed (gloo) and, where they
are installed, Horovod and MPI itself (Open MPI's mpirun with mpi4py), side by side in the same run.

    python benches/collectives.py --out bench-out/                 # full run (5 rounds, ~10 min on 2 cores)
    python benches/collectives.py --quick --out bench-out-quick/   # ~1-2 minute smoke run

Every round runs one job per implementation, in the order --impls gives (default rvod-shm, rvod-tcp, gloo,
plus horovod when `import horovod` would work), so rounds alternate A B C A B C ...; every rank has one compute
thread. rvod jobs are `rvodrun -np N python benches/collectives_worker.py ...` with RVOD_SHM=1 (rvod-shm) or
RVOD_SHM=0 (rvod-tcp), and each rank checks that rvod really runs over that transport; Horovod jobs are
`horovodrun -np N -H localhost:N ...` driving horovod.torch; gloo jobs are N ranks with MASTER_ADDR=127.0.0.1
and a free port; MPI jobs are `mpirun -np N` driving mpi4py on NumPy arrays. A job measures, after warm-up:
allreduce latency (4 B .. 8 KiB, p50/p90; for rvod also a torch tensor through rvod.torch), barrier, 8 B
broadcast and 4 B / 1 KiB allgather latency, allreduce bus bandwidth in place (64 KiB .. --max-size, rotating buffers larger than the
L3 cache) and out of place (a few sizes), allgather and broadcast bus bandwidth at a few sizes, and a step of
1,024 x 4 KiB tensors (rvod and Horovod: allreduce_async_ each then synchronize, and one grouped_allreduce_;
gloo: one by one, and async_op=True then wait; MPI: Iallreduce each then Waitall) against one in-place
allreduce of the same total size in the same job.

The report gives each implementation's median [min-max] over rounds and "a vs b" speedups (every
implementation vs gloo, rvod-shm vs rvod-tcp, rvod vs horovod) as the median [min-max] of per-round ratios,
then the targets of issue 5. Writes to --out: collectives.csv (raw per-rank samples and per-round metrics:
impl, op, size_bytes, round, metric, value, rank), collectives.json (machine, versions, git commit, plan,
transports, summary), collectives.txt (the table printed on stdout, with issue 5's targets and, when MPI ran,
issue 19's) and collectives.png (bus bandwidth and
latency against size, one line per implementation). See docs/performance.md for the method and results.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import collectives_launch as launch
import collectives_machine as machine
import collectives_report as report

KiB, MiB = 1 << 10, 1 << 20


def _powers(lo, hi, factor):
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def build_plan(args):
    if args.quick:
        bw = [s for s in (64 * KiB, 1 * MiB, 4 * MiB, 64 * MiB) if s <= args.max_size]
        plan = {"latency_sizes": [4, 64, 1024, 8 * KiB], "latency_iters": 200, "latency_warmup": 20,
                "bw_sizes": bw, "allgather_sizes": [1 * MiB], "broadcast_sizes": [1 * MiB],
                "out_of_place_sizes": [s for s in (1 * MiB, 64 * MiB) if s <= args.max_size],
                "bw_budget_bytes": 64 * MiB, "bw_min_calls": 3, "bw_max_calls": 50,
                "fusion_steps": 2, "fusion_warmup": 1, "fusion_warmup_s": 0.05, "fusion_single_calls": 5}
    else:
        few = [s for s in (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB) if s <= args.max_size]
        plan = {"latency_sizes": _powers(4, 8 * KiB, 2), "latency_iters": 1000, "latency_warmup": 100,
                "bw_sizes": _powers(64 * KiB, args.max_size, 4), "allgather_sizes": few, "broadcast_sizes": few,
                "out_of_place_sizes": few + [s for s in (256 * MiB,) if s <= args.max_size],
                "bw_budget_bytes": 512 * MiB, "bw_min_calls": 3, "bw_max_calls": 200,
                "fusion_steps": 5, "fusion_warmup": 1, "fusion_warmup_s": 0.25, "fusion_single_calls": 20}
    plan.update(bw_warmup=2, working_set_bytes=64 * MiB, fusion_count=1024, fusion_tensor_bytes=4 * KiB,
                rvod_torch_input_sizes=[4], barrier_latency=True, broadcast_latency_sizes=[8],
                allgather_latency_sizes=[4, 1024], phases=args.phases.split(","), impls=args.impls)
    if args.latency_iters is not None:
        plan["latency_iters"] = args.latency_iters
    if args.latency_warmup is not None:
        plan["latency_warmup"] = args.latency_warmup
    if args.fusion_steps is not None:
        plan["fusion_steps"] = args.fusion_steps
    return plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of A B C ... (default 5; --quick: 2)")
    p.add_argument("--quick", action="store_true", help="a ~1-2 minute smoke run: fewer sizes, calls and rounds")
    p.add_argument("--max-size", type=int, default=256 * MiB, help="largest bandwidth size in bytes (default 256 MiB)")
    p.add_argument("--latency-iters", type=int, default=None, help="timed calls per latency size (default 1000)")
    p.add_argument("--latency-warmup", type=int, default=None, help="untimed calls before them (default 100)")
    p.add_argument("--fusion-steps", type=int, default=None, help="timed fused steps per round (default 5)")
    p.add_argument("--phases", default="latency,bandwidth,fusion", help="comma list of latency,bandwidth,fusion")
    p.add_argument("--impls", default=None,
                   help="comma list of rvod-shm, rvod-tcp, gloo, horovod, mpi, in the order each round runs them "
                        "(default rvod-shm,rvod-tcp,gloo, horovod when it is importable, mpi when mpi4py and "
                        "mpirun are installed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one job may take before it is stopped")
    p.add_argument("--rvodrun", default=None, help="rvodrun to use (default: the one beside this python)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the table, CSV and plot from OUT/raw and OUT/collectives.json")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if not args.report_only:
        args.impls = _pick_impls(p, args.impls)
    return args


def _pick_impls(parser, text):
    """The --impls list, checked; horovod is dropped, with a note, where it cannot be imported."""
    impls = text.split(",") if text else launch.default_impls()
    unknown = [i for i in impls if i not in launch.IMPLS]
    if unknown or len(set(impls)) != len(impls):
        parser.error(f"--impls: give each of {', '.join(launch.IMPLS)} at most once, not {text!r}")
    if not launch.horovod_available():
        print("note: horovod is not importable in this Python, so it is not measured", file=sys.stderr)
        if "horovod" in impls:
            impls.remove("horovod")
    if not launch.mpi_available():
        print("note: mpi4py or mpirun is missing, so MPI is not measured", file=sys.stderr)
        if "mpi" in impls:
            impls.remove("mpi")
    return impls


def run_rounds(args, out, raw_dir, plan_path, argv):
    """Run every round (one job per implementation, in order); returns the run's metadata."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(raw_dir.glob("round*.json")) + list(raw_dir.glob("round*.log")):
        stale.unlink()
    plan_path.write_text(json.dumps(build_plan(args), indent=1))
    meta = machine.describe(argv if argv is not None else sys.argv, launch.find_rvodrun(args.rvodrun))
    started = time.monotonic()
    for rnd in range(args.rounds):
        for impl in args.impls:
            t0 = time.monotonic()
            launch.run_job(impl, args.np, plan_path, raw_dir, rnd, raw_dir / f"round{rnd}.{impl}.log",
                           args.timeout, args.rvodrun)
            print(f"round {rnd + 1}/{args.rounds} {impl}: {time.monotonic() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    meta["wall_s"] = round(time.monotonic() - started, 1)
    return meta


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    raw_dir = out / "raw"
    plan_path = out / "plan.json"
    if args.report_only:
        plan = json.loads(plan_path.read_text())
        meta = json.loads((out / "collectives.json").read_text())["meta"]
    else:
        meta = run_rounds(args, out, raw_dir, plan_path, argv)
        plan = json.loads(plan_path.read_text())

    docs = [json.loads(p.read_text()) for p in sorted(raw_dir.glob("round*.json"))]
    n, metrics, rows = report.aggregate(docs)
    rounds = sorted({d["round"] for d in docs})
    impls = report.impl_order(docs, plan)
    seen_transports = report.transports(docs)
    summary = report.summarize(metrics, rounds, impls)
    lines = report.table_lines(summary, n, plan, rounds, impls, seen_transports)
    lines += [""] + report.target_lines(summary, plan)
    if "mpi" in impls:
        lines += report.mpi_target_lines(summary, plan)
    lines += [""]
    lines.append(f"commit: {meta['git']['describe']}; rvod engine: {meta['rvod'].get('extension')} "
                 f"(sha256 {meta['rvod'].get('extension_sha256', '?')[:12]}); wall {meta['wall_s']} s")
    text = "\n".join(lines)
    print(text)

    report.write_csv(out / "collectives.csv", rows)
    (out / "collectives.txt").write_text(text + "\n")
    (out / "collectives.json").write_text(json.dumps({
        "meta": meta, "plan": plan, "ranks": n, "impls": impls, "transports": seen_transports,
        "job_timings": {f"round{d['round']}.{d['impl']}.rank{d['rank']}": d["timings"] for d in docs},
        "summary": {f"{op}/{size}": value for (op, size), value in summary.items()},
    }, indent=1, default=str))
    report.plot(out / "collectives.png", summary, n, impls)
    print(f"\nwrote {out / 'collectives.csv'}, {out / 'collectives.json'}, {out / 'collectives.png'}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
