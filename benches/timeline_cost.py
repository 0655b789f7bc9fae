"""What recording a timeline costs: training steps and an allreduce burst with the timeline off and on,
alternating in the same run (rounds off, on, off, on, ...) so machine noise hits both alike.

    RVOD_TIMELINE=DYNAMIC RVOD_CACHE_CAPACITY=2048 rvodrun -np 2 python benches/timeline_cost.py [--rounds 6]

(a) a training step of a small MLP with rvod.torch's DistributedOptimizer (10 gradient tensors);
(b) 1,024 float32 tensors of 4 KiB: allreduce_async_ of each, then synchronize (the most events per second).
Times are the slower rank's median per round, and the process CPU time per step (all threads: engine,
timeline writer; the mean of the ranks), which machine load disturbs less than wall time. Printed: each
round and the median on/off ratios.
"""

import argparse
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import rvod.torch as hvd


def slowest(seconds):
    return hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="timeline_cost.slowest").item()


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mean_cpu(seconds):
    return hvd.allreduce(torch.tensor([seconds]), op=hvd.Average, name="timeline_cost.cpu").item()


def mlp_training_step():
    """A training step of a small MLP with rvod.torch's DistributedOptimizer (10 gradient tensors); also used
    by benches/autotune.py."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                          nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def training(steps):
    step = mlp_training_step()
    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return slowest(statistics.median(times))


def burst(steps):
    tensors = [torch.full((1024,), float(i)) for i in range(1024)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=f"burst.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
        times.append(time.perf_counter() - start)
    return slowest(statistics.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=tempfile.gettempdir())
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    path = os.path.join(args.out, f"timeline_cost.{os.getpid() if hvd.rank() == 0 else 0}.json")
    path = hvd.broadcast_object(path, root_rank=0)
    results = {"training": ([], []), "burst": ([], [])}
    cpu = {"training": ([], []), "burst": ([], [])}
    for round_ in range(args.rounds):
        on = round_ % 2 == 1
        if on:
            hvd.start_timeline(path)
        for name, run, steps in (("training", training, 30), ("burst", burst, 8)):
            before = cpu_seconds()
            results[name][on].append(run(steps))
            cpu[name][on].append(mean_cpu((cpu_seconds() - before) / steps))
        if on:
            hvd.stop_timeline()
        if hvd.rank() == 0:
            print(f"round {round_} timeline {'on ' if on else 'off'}: training step "
                  f"{results['training'][on][-1] * 1e3:.3f} ms, 1,024 x 4 KiB {results['burst'][on][-1] * 1e3:.2f} ms",
                  flush=True)
    if hvd.rank() == 0:
        for name, (off, on) in results.items():
            ratio = statistics.median(on) / statistics.median(off)
            cpu_off, cpu_on = (statistics.median(c) for c in cpu[name])
            print(f"{name}: step off {statistics.median(off) * 1e3:.3f} ms, on {statistics.median(on) * 1e3:.3f} ms, "
                  f"on/off {ratio:.3f}; CPU per step off {cpu_off * 1e3:.3f} ms, on {cpu_on * 1e3:.3f} ms, "
                  f"on/off {cpu_on / cpu_off:.3f}")
        print(f"timeline: {os.path.getsize(path) / 1e6:.1f} MB at {path}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
