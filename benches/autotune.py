"""Autotune against a grid search over the same knobs, in the same job (a report, not a test).

    python benches/autotune.py [--rounds 60] [--block 10] [--workloads burst training] [--out DIR]

One 2-rank rvodrun job per workload, started with --autotune (default sampling: 3 warm-up samples, 10 steps
per sample, 20 Bayesian samples). In that job:
  - tuning: it trains until the autotune log's closing line (`# best:`) appears, checked every 10 steps, at
    most 1,000 steps; autotune's final values are the last ones every rank applied (`autotune_applied()`);
  - comparison: --rounds rounds, each measuring every configuration once in a block of --block timed steps:
    the grid points (fusion threshold {1, 8, 64} MiB x cycle time {0.2, 1, 5} ms, response cache on) and
    autotune's final values, in a new order each round (a seeded shuffle, the same on every rank). Before a
    block every rank calls the private hook `_rvod._set_tuned_values` at the same step; the values travel in
    rank 0's next round header, as autotune's own do, and every rank applies them when that round ends; 3
    untimed steps follow (the switch, and a response cache that was turned on refilling) before the timer
    starts. Comparing configurations inside one job, block by block, makes the machine's load common to all
    of them: on a shared VM separate jobs differ by more than the knobs do.
Workloads (as benches/timeline_cost.py): `burst`, 1,024 float32 tensors of 4 KiB (allreduce_async_ of each,
then synchronize); `training`, a step of a small MLP with rvod.torch's DistributedOptimizer.
A block's time per step is the slower rank's median step. A configuration's relative time is the median over
rounds of its block's time divided by the median block of that round (the load level of a round, common to
all its blocks, divides out); the grid's best is the grid point with the lowest, and the verdict is its
relative time over autotune's values' (their throughput as a fraction of the grid's best). Printed:
autotune's values, the steps it took and its log's closing line, each configuration's times, the verdict,
a 90% bootstrap interval for it (rounds drawn with replacement, the grid's best chosen afresh in each
draw), and the same ratio from raw medians (ms/step) for comparison.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID_FUSION_MIB = [1, 8, 64]
GRID_CYCLE_MS = [0.2, 1, 5]
MAX_TUNING_STEPS = 1000
SWITCH_STEPS = 3
AUTOTUNE = "autotune's values"


def configurations(final):
    """Name -> (fusion threshold bytes, cycle time ms, cache on): the grid, then autotune's final values."""
    configs = {f"fusion {fusion:>2} MiB cycle {cycle:>3} ms": (fusion << 20, float(cycle), True)
               for fusion in GRID_FUSION_MIB for cycle in GRID_CYCLE_MS}
    configs[AUTOTUNE] = (final["fusion_threshold"], final["cycle_time_ms"], final["cache_enabled"])
    return configs


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

    tuning_steps = 0
    done = torch.zeros(1)
    while tuning_steps < MAX_TUNING_STEPS and done[0] == 0:
        for _ in range(10):
            step()
        tuning_steps += 10
        if hvd.rank() == 0:
            done[0] = float(any(line.startswith("# best:") for line in Path(args.log).read_text().splitlines()))
        done = hvd.broadcast(done, root_rank=0, name="bench.autotune.done")
    settled = bool(done[0])
    # The closing line is written before the best values are applied: a few more steps let them land.
    for _ in range(SWITCH_STEPS):
        step()
    applied = _rvod.autotune_applied()
    final = applied[-1]
    configs = configurations(final)
    names = list(configs)

    times = []  # (round, name, seconds per step on this rank)
    for round_ in range(args.rounds):
        order = names[:]
        random.Random(round_).shuffle(order)
        for name in order:
            _rvod._set_tuned_values(*configs[name])
            for _ in range(SWITCH_STEPS):
                step()
            steps = []
            for _ in range(args.block):
                start = time.perf_counter()
                step()
                steps.append(time.perf_counter() - start)
            times.append((round_, name, statistics.median(steps)))
    slowest = hvd.allreduce(torch.tensor([t for _, _, t in times], dtype=torch.float64), op=hvd.Max,
                            name="bench.slowest").tolist()
    after = _rvod.autotune_applied()
    if hvd.rank() == 0:
        Path(args.result).write_text(json.dumps({
            "tuning_steps": tuning_steps, "settled": settled, "final": final, "configs": configs,
            "blocks": [[r, name, t] for (r, name, _), t in zip(times, slowest)],
            # Every switch was applied: autotune's own values, then one entry per block.
            "switches_applied": len(after) - len(applied)}))
    hvd.shutdown()


def run_job(workload, args, out):
    result = out / f"result.{workload}.json"
    log = out / f"autotune.{workload}.csv"
    # Positional worker arguments: rvodrun would take option-like ones for its own.
    command = [sys.executable, "-m", "rvod.runner", "-np", "2", "--autotune", "--autotune-log-file", str(log),
               sys.executable, __file__, "worker", workload, str(args.rounds), str(args.block), str(result), str(log)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{workload} job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result.read_text()), log


def report(workload, result, log):
    final = result["final"]
    print(f"{workload}: autotune {'settled' if result['settled'] else 'had NOT settled'} after "
          f"{result['tuning_steps']} steps on fusion {final['fusion_threshold'] / (1 << 20):.2f} MiB, cycle "
          f"{final['cycle_time_ms']:.3f} ms, cache {'on' if final['cache_enabled'] else 'off'}", flush=True)
    print(f"{workload}: log {log}: {log.read_text().splitlines()[-1]}", flush=True)
    expected = len(result["blocks"])
    print(f"{workload}: {result['switches_applied']} of {expected} switches applied on every rank", flush=True)
    by_round = {}
    for round_, name, seconds in result["blocks"]:
        by_round.setdefault(round_, {})[name] = seconds
    rounds = list(by_round.values())
    names = list(rounds[0])
    raw = {name: statistics.median(r[name] for r in rounds) for name in names}
    relative = relative_times(rounds, names)
    for name in names:
        spread = ", ".join(f"{r[name] * 1e3:.2f}" for r in rounds)
        print(f"{workload}: {name}: {raw[name] * 1e3:8.3f} ms/step, {relative[name]:.3f} of its round's median "
              f"(rounds: {spread})", flush=True)
    grid_best, ratio = verdict(relative)
    raw_best = min((name for name in names if name != AUTOTUNE), key=raw.get)
    # How sure: the same verdict over rounds drawn with replacement (the grid's best chosen afresh each time).
    rng = random.Random(0)
    draws = sorted(verdict(relative_times([rng.choice(rounds) for _ in rounds], names))[1] for _ in range(1000))
    print(f"{workload}: autotune's values reach {ratio * 100:.1f}% of the grid's best throughput ({grid_best}; "
          f"90% of bootstrap draws {draws[50] * 100:.1f}-{draws[949] * 100:.1f}%); from raw medians "
          f"{raw[raw_best] / raw[AUTOTUNE] * 100:.1f}% ({raw_best}: {raw[raw_best] * 1e3:.3f} ms/step, "
          f"autotune's {raw[AUTOTUNE] * 1e3:.3f})", flush=True)


def relative_times(rounds, names):
    """Each configuration's time per step as a fraction of its round's median over all configurations, the
    median over rounds: a round's load level, common to its blocks, divides out."""
    return {name: statistics.median(r[name] / statistics.median(r.values()) for r in rounds) for name in names}


def verdict(relative):
    """The grid's best configuration, and the throughput of autotune's values as a fraction of its."""
    grid_best = min((name for name in relative if name != AUTOTUNE), key=relative.get)
    return grid_best, relative[grid_best] / relative[AUTOTUNE]


def driver(args):
    out = Path(args.out or tempfile.mkdtemp(prefix="rvod-autotune-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads:
        result, log = run_job(workload, args, out)
        report(workload, result, log)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="blocks per configuration (the median is taken)")
    parser.add_argument("--block", type=int, default=10, help="timed steps per block")
    parser.add_argument("--workloads", nargs="+", default=["burst", "training"], choices=["burst", "training"])
    parser.add_argument("--out", help="directory for the logs and results (default: a new temporary one)")
    if sys.argv[1:2] == ["worker"]:
        workload, rounds, block, result, log = sys.argv[2:7]
        worker(argparse.Namespace(workload=workload, rounds=int(rounds), block=int(block), result=result, log=log))
    else:
        driver(parser.parse_args())


if __name__ == "__main__":
    main()
