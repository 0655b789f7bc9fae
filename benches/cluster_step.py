"""The same 2-rank rvod.torch training step under rvodrun, Ray (RayExecutor) and Spark (rvod.spark.run), in
one run on this machine.

    python benches/cluster_step.py [--steps 60] [--rounds 3] [--spark-master local-cluster[1,2,1024]]

Each round starts one job per launcher, in turn, so machine noise hits all of them alike. Measured per job:
start-up (from the call that starts the job to the end of the first training step on rank 0: rvodrun's
processes, or Ray's actors and placement group, or Spark's barrier stage and rank processes, plus imports and
hvd.init; the Ray instance and the Spark session themselves are started once, before the first round, and
reported apart) and the step time (median of the per-step times of the slower rank, after the first
--warmup steps). Printed: every job, then for Ray and Spark the median over rounds of their step time and
start-up against rvodrun's in the same round. The model is an MLP of about 1.1 M parameters (4.5 MB of
gradients per step) on a batch of 64 per rank, one thread per rank.
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


def train_steps(steps, warmup, started_at):
    """Runs on every rank: ``steps`` training steps; (seconds from ``started_at`` to the first step's end,
    median step seconds of the slower rank)."""
    import torch
    import torch.nn.functional as F

    import rvod.torch as hvd

    hvd.init()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        data, target = torch.randn(64, 512), torch.randint(0, 10, (64,))
        times = []
        first_step_done = None
        for _ in range(steps):
            begin = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            times.append(time.perf_counter() - begin)
            if first_step_done is None:
                first_step_done = time.time() - started_at
        slowest = hvd.allreduce(torch.tensor(times[warmup:], dtype=torch.float64), op=hvd.Max, name="times")
        return first_step_done, statistics.median(slowest.tolist())
    finally:
        hvd.shutdown()


def under_rvodrun(steps, warmup):
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "result.json"
        code = ("import json, sys, time; sys.path.insert(0, {bench!r}); import cluster_step as b; "
                "import os; r = b.train_steps({steps}, {warmup}, float(os.environ['BENCH_START'])); "
                "os.environ['RVOD_RANK'] == '0' and open({out!r}, 'w').write(json.dumps(r))").format(
            bench=str(Path(__file__).parent), steps=steps, warmup=warmup, out=str(out))
        started = time.time()
        env = dict(os.environ, BENCH_START=repr(started))
        subprocess.run([sys.executable, "-m", "rvod.runner", "-np", "2", sys.executable, "-c", code], env=env,
                       check=True, timeout=600)
        return json.loads(out.read_text())


def under_ray(steps, warmup):
    from rvod.ray import RayExecutor

    started = time.time()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    try:
        return executor.run(train_steps, args=[steps, warmup, started])[0]
    finally:
        executor.shutdown()


def under_spark(steps, warmup):
    import rvod.spark

    started = time.time()
    return rvod.spark.run(train_steps, args=(steps, warmup, started), num_proc=2)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spark-master", default="local-cluster[1,2,1024]")
    args = parser.parse_args()

    import cloudpickle
    import ray
    from pyspark.sql import SparkSession

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    begin = time.time()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray_up = time.time() - begin
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Spark binds to the address its host name resolves to and, where that is loopback, to the first other
    # interface's: on this machine that is not ours to use. The benchmark is one machine: loopback it is.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    begin = time.time()
    spark = (SparkSession.builder.master(args.spark_master).config("spark.ui.enabled", "false")
             .config("spark.executor.memory", "1g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.parallelize(range(2), 2).count()  # the executors are up
    spark_up = time.time() - begin
    print(f"once: ray.init {ray_up:.1f} s, Spark session ({args.spark_master}) {spark_up:.1f} s")

    launchers = {"rvodrun": under_rvodrun, "ray": under_ray, "spark": under_spark}
    rows = []
    for round_index in range(args.rounds):
        row = {}
        for name, launch in launchers.items():
            start_up, step = launch(args.steps, args.warmup)
            row[name] = (start_up, step)
            print(f"round {round_index}: {name:8s} start-up {start_up:6.2f} s   step {1000 * step:7.2f} ms",
                  flush=True)
        rows.append(row)
    spark.stop()
    ray.shutdown()
    print("\nmedian over rounds, against rvodrun in the same round (step: 1.00 = as fast):")
    for name in ("ray", "spark"):
        step_ratio = statistics.median(row[name][1] / row["rvodrun"][1] for row in rows)
        start_extra = statistics.median(row[name][0] - row["rvodrun"][0] for row in rows)
        print(f"  {name:6s} step time x{step_ratio:.3f}   start-up {start_extra:+.1f} s")
    print(f"  rvodrun step {1000 * statistics.median(row['rvodrun'][1] for row in rows):.2f} ms, "
          f"start-up {statistics.median(row['rvodrun'][0] for row in rows):.1f} s")


if __name__ == "__main__":
    main()
