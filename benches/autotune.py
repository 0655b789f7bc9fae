"""Autotune against a grid search over the same knobs, in the same run (a report, not a test).

    python benches/autotune.py [--steps 60] [--rounds 3] [--workloads burst training] [--out DIR]

For each workload, this driver starts 2-rank jobs with rvodrun, one after another:
  - one with --autotune (default sampling: 3 warm-up samples, 10 steps per sample, 20 Bayesian samples):
    it trains until the autotune log's closing line appears (checked every 10 steps, at most 1,000 steps),
    then times --steps steps at the values autotune settled on, in that same job;
  - then --rounds rounds of one job per grid point, the knobs pinned with rvodrun flags (fusion threshold
    {1, 8, 64} MiB x cycle time {0.2, 1, 5} ms, response cache on), and one with autotune's final values
    pinned, in a rotating order so a busy minute of a shared machine does not land on one configuration.
Workloads (as benches/timeline_cost.py): `burst`, 1,024 float32 tensors of 4 KiB (allreduce_async_ of each,
then synchronize); `training`, a step of a small MLP with rvod.torch's DistributedOptimizer.
A job's time per step is the slower rank's median over blocks of 10 steps; a configuration's, the median
over its rounds. Printed: autotune's values, the steps it took and its log's closing line, each
configuration's time, and the throughput of autotune's values as a fraction of the grid's best.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID_FUSION_MIB = [1, 8, 64]
GRID_CYCLE_MS = [0.2, 1, 5]
MAX_TUNING_STEPS = 1000


def worker(args):
    import torch

    import rvod.torch as hvd
    from rvod import _rvod

    torch.set_num_threads(1)
    hvd.init()
    if args.workload == "burst":
        tensors = [torch.full((1024,), float(i)) for i in range(1024)]

        def step():
            handles = [hvd.allreduce_async_(t, name=f"burst.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
            for h in handles:
                hvd.synchronize(h)
    else:
        from timeline_cost import mlp_training_step

        step = mlp_training_step()

    tuning_steps = None
    if args.log:
        tuning_steps = 0
        done = torch.zeros(1)
        while tuning_steps < MAX_TUNING_STEPS and done[0] == 0:
            for _ in range(10):
                step()
            tuning_steps += 10
            if hvd.rank() == 0:
                done[0] = float(any(line.startswith("# best:") for line in Path(args.log).read_text().splitlines()))
            done = hvd.broadcast(done, root_rank=0, name="bench.autotune.done")
    else:
        for _ in range(20):
            step()
    blocks = []
    for _ in range(max(1, args.steps // 10)):
        start = time.perf_counter()
        for _ in range(10):
            step()
        blocks.append((time.perf_counter() - start) / 10)
    slowest = hvd.allreduce(torch.tensor([statistics.median(blocks)]), op=hvd.Max, name="bench.slowest").item()
    applied = _rvod.autotune_applied()
    if hvd.rank() == 0:
        Path(args.result).write_text(json.dumps({"step_s": slowest, "tuning_steps": tuning_steps,
                                                 "final": applied[-1] if applied else None}))
    hvd.shutdown()


def run_job(workload, steps, out, flags, log=None, settings=None):
    result = out / f"result.{os.getpid()}.json"
    # Positional worker arguments: rvodrun would take option-like ones for its own.
    command = [sys.executable, "-m", "rvod.runner", "-np", "2", *flags, sys.executable, __file__, "worker",
               workload, str(steps), str(result), str(log or "")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **(settings or {})})
    if done.returncode != 0:
        raise SystemExit(f"job {flags} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def pinned(values):
    """The variables that pin the knobs to `values` (an entry of autotune_applied())."""
    settings = {"RVOD_FUSION_THRESHOLD": str(values["fusion_threshold"]),
                "RVOD_CYCLE_TIME": f"{values['cycle_time_ms']:.3f}"}
    return settings | ({} if values["cache_enabled"] else {"RVOD_CACHE_CAPACITY": "0"})


def driver(args):
    out = Path(args.out or tempfile.mkdtemp(prefix="rvod-autotune-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads:
        log = out / f"autotune.{workload}.csv"
        tuned = run_job(workload, args.steps, out, ["--autotune", "--autotune-log-file", str(log)], log)
        final = tuned["final"]
        print(f"{workload}: autotune settled after {tuned['tuning_steps']} steps on fusion "
              f"{final['fusion_threshold'] / (1 << 20):.2f} MiB, cycle {final['cycle_time_ms']:.3f} ms, cache "
              f"{'on' if final['cache_enabled'] else 'off'}; then {tuned['step_s'] * 1e3:.3f} ms/step in that job",
              flush=True)
        print(f"{workload}: log {log}: {log.read_text().splitlines()[-1]}", flush=True)
        configs = {f"fusion {fusion:>2} MiB cycle {cycle:>3} ms": pinned(
            {"fusion_threshold": fusion << 20, "cycle_time_ms": cycle, "cache_enabled": True})
            for fusion in GRID_FUSION_MIB for cycle in GRID_CYCLE_MS}
        configs["autotune's values"] = pinned(final)
        times = {name: [] for name in configs}
        names = list(configs)
        for round_ in range(args.rounds):
            # Each round in another order, so slow minutes of a shared machine fall on different configs.
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                times[name].append(run_job(workload, args.steps, out, [], settings=configs[name])["step_s"])
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, median in medians.items():
            spread = ", ".join(f"{t * 1e3:.2f}" for t in times[name])
            print(f"{workload}: {name}: {median * 1e3:8.3f} ms/step (rounds: {spread})", flush=True)
        grid_best = min((name for name in medians if name != "autotune's values"), key=medians.get)
        ratio = medians[grid_best] / medians["autotune's values"]
        print(f"{workload}: autotune's values reach {ratio * 100:.1f}% of the grid's best throughput "
              f"({grid_best}: {medians[grid_best] * 1e3:.3f} ms/step)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per job (in blocks of 10)")
    parser.add_argument("--rounds", type=int, default=3, help="jobs per configuration (the median is taken)")
    parser.add_argument("--workloads", nargs="+", default=["burst", "training"], choices=["burst", "training"])
    parser.add_argument("--out", help="directory for the logs (default: a new temporary one)")
    if sys.argv[1:2] == ["worker"]:
        workload, steps, result, log = sys.argv[2:6]
        worker(argparse.Namespace(workload=workload, steps=int(steps), result=result, log=log or None))
    else:
        driver(parser.parse_args())


if __name__ == "__main__":
    main()
