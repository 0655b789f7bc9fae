"""Measure rvod's allreduce at 2..32 ranks on this machine and fit the alpha-beta model's parameters to it.

    python benches/scale_fit.py --out bench-out/scale_fit            # measure (~5-8 min on 2 cores), then fit
    python benches/scale_fit.py --out bench-out/scale_fit --fit-only # refit from bench-out/scale_fit/raw.csv

Each measurement is one job, `rvodrun -np N python benches/allreduce_loop.py --bytes B --calls C --warmup W`
(the bare allreduce loop, one fixed float32 array, every rank prints its p50 per call), over shared memory
(RVOD_SHM=1) and TCP (RVOD_SHM=0), for N = --np (default 2,4,8,16,32) and B = 4 B (rides in the round headers:
one all-to-all of N-1 headers per rank), 32 KiB (a header round, then recursive doubling), 4 MiB and 32 MiB (a
header round, then the ring). The time of a size at N is the largest rank's p50. Every job has a time limit.

The fit (`fit`) takes the N <= --fit-max-np runs (default 2: this machine has 2 cores, so every larger job is
oversubscribed; those are shown next to the model's prediction, not fitted) and finds, per transport, the
parameters of `scale_model`'s BEFORE design (this build's algorithms) that minimise the squared log error:
alpha (one message, end to end; o = alpha/2, a rank's serialised share of it at each end), beta (per byte) and
t_op (a fixed software cost per operation: submission, hand-offs, completion; not a message cost). Writes
raw.csv and fit.json.
"""

import argparse
import csv
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import collectives_launch as launch  # noqa: E402
import scale_model as model  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4, 32 * KiB, 4 * MiB, 32 * MiB)
TRANSPORTS = {"shm": "1", "tcp": "0"}
P50 = re.compile(r"rank (\d+): .* p50 ([0-9.]+) us")


def calls_for(size, n):
    """(timed calls, warm-up calls) for one job: fewer for larger sizes and more ranks (each call costs more)."""
    if size <= 64 * KiB:
        return max(60, 2400 // n), max(20, 240 // n)
    return max(4, min(40, (256 * MiB) // (size * n))), 2


def measure_one(transport, n, size, timeout, rvodrun=None):
    """The largest rank's p50 (us) of one job, or None if it failed or ran out of time (the reason is printed)."""
    calls, warmup = calls_for(size, n)
    cmd = [launch.find_rvodrun(rvodrun), "-np", str(n), sys.executable, str(HERE / "allreduce_loop.py"),
           "--bytes", str(size), "--calls", str(calls), "--warmup", str(warmup)]
    env = launch._base_env()
    env["RVOD_SHM"] = TRANSPORTS[transport]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"  {transport} np={n} {size} B: over {timeout} s, skipped", file=sys.stderr)
        return None
    p50s = {int(m.group(1)): float(m.group(2)) for m in P50.finditer(done.stdout)}
    if done.returncode != 0 or len(p50s) != n:
        tail = (done.stdout + done.stderr)[-800:]
        print(f"  {transport} np={n} {size} B: exit {done.returncode}, {len(p50s)}/{n} ranks reported:\n{tail}",
              file=sys.stderr)
        return None
    return max(p50s.values())


def measure(args, raw_path):
    rows = []
    started = time.monotonic()
    for n in args.np:
        for transport in args.transports:
            for size in SIZES:
                t0 = time.monotonic()
                p50 = measure_one(transport, n, size, args.timeout, args.rvodrun)
                if p50 is not None:
                    rows.append({"transport": transport, "np": n, "size_bytes": size, "p50_us": p50})
                print(f"{transport} np={n:3d} {size:>9d} B: {p50 if p50 is not None else 'failed'} us "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    with open(raw_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["transport", "np", "size_bytes", "p50_us"])
        w.writeheader()
        w.writerows(rows)
    print(f"measured in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return rows


def read_raw(raw_path):
    with open(raw_path) as f:
        return [{"transport": r["transport"], "np": int(r["np"]), "size_bytes": int(r["size_bytes"]),
                 "p50_us": float(r["p50_us"])} for r in csv.DictReader(f)]


def predict_us(params, t_op_us, n, size):
    """What the BEFORE design predicts for one measured point: its allreduce time plus the fixed per-op cost."""
    return model.allreduce_us("before", n, size, params) + t_op_us


def fit(rows, max_np):
    """Per transport: the BEFORE-design parameters minimising the squared log error over the N <= max_np rows
    (scipy's Nelder-Mead on log-parameters, from a grid's best point)."""
    from scipy.optimize import minimize

    fitted = {}
    for transport in sorted({r["transport"] for r in rows}):
        points = [r for r in rows if r["transport"] == transport and r["np"] <= max_np]
        if len(points) < 3:
            continue

        def unpack(x):
            alpha = math.exp(x[0])
            return model.Params(alpha_us=alpha, o_us=alpha / 2, beta_ns_per_byte=math.exp(x[1])), math.exp(x[2])

        def loss(x):
            params, t_op = unpack(x)
            return sum((math.log(predict_us(params, t_op, p["np"], p["size_bytes"])) - math.log(p["p50_us"])) ** 2
                       for p in points)

        grid = [(math.log(a), math.log(b), math.log(t)) for a in (1, 3, 10, 30) for b in (0.1, 0.3, 1.0, 3.0)
                for t in (0.1, 1, 5)]
        best = minimize(loss, min(grid, key=loss), method="Nelder-Mead",
                        options={"maxiter": 3000, "xatol": 1e-4, "fatol": 1e-8})
        params, t_op = unpack(best.x)
        residuals = [{"np": p["np"], "size_bytes": p["size_bytes"], "measured_us": p["p50_us"],
                      "predicted_us": round(predict_us(params, t_op, p["np"], p["size_bytes"]), 2),
                      "measured_over_predicted": round(p["p50_us"] / predict_us(params, t_op, p["np"],
                                                                                p["size_bytes"]), 2)}
                     for p in sorted(rows, key=lambda r: (r["np"], r["size_bytes"])) if p["transport"] == transport]
        fitted[transport] = {"alpha_us": round(params.alpha_us, 3), "o_us": round(params.o_us, 3),
                             "beta_ns_per_byte": round(params.beta_ns_per_byte, 4), "t_op_us": round(t_op, 3),
                             "rms_log_error": round(math.sqrt(best.fun / len(points)), 4),
                             "fitted_on_np": sorted({p["np"] for p in points}), "points": residuals}
    return fitted


def print_fit(fitted, max_np):
    for transport, f in fitted.items():
        print(f"{transport}: alpha {f['alpha_us']} us, o {f['o_us']} us, beta {f['beta_ns_per_byte']} ns/B "
              f"({1 / f['beta_ns_per_byte']:.2f} GB/s), t_op {f['t_op_us']} us; rms log error {f['rms_log_error']} "
              f"over np {f['fitted_on_np']}")
        print(f"    np |      size |  measured us | predicted us | measured/predicted   (np > {max_np}: not fitted)")
        for p in f["points"]:
            print(f"  {p['np']:4d} | {model.size_label(p['size_bytes']):>9} | {p['measured_us']:12.1f} | "
                  f"{p['predicted_us']:12.1f} | {p['measured_over_predicted']:8.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/scale_fit")
    p.add_argument("--np", default="2,4,8,16,32", help="comma list of rank counts (default 2,4,8,16,32)")
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--fit-max-np", type=int, default=2,
                   help="fit on jobs of at most this many ranks (default 2: this machine's cores)")
    p.add_argument("--timeout", type=float, default=120, help="seconds one job may take (default 120)")
    p.add_argument("--rvodrun", default=None)
    p.add_argument("--fit-only", action="store_true", help="measure nothing: refit OUT/raw.csv")
    args = p.parse_args(argv)
    args.np = [int(v) for v in args.np.split(",")]
    args.transports = args.transports.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_raw(out / "raw.csv") if args.fit_only else measure(args, out / "raw.csv")
    fitted = fit(rows, args.fit_max_np)
    print_fit(fitted, args.fit_max_np)
    (out / "fit.json").write_text(json.dumps(fitted, indent=1))
    print(f"wrote {out / 'raw.csv'}, {out / 'fit.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
