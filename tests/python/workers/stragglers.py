"""Straggler worker (4 ranks): each step submits two gradient-like allreduces asynchronously, each after a
stretch of "compute" (a sleep), as backward hooks do, then waits for both.

- ``slow``: rank 3's compute takes 1.5x the others' (40 ms -> 60 ms a step). Every rank's
  ``hvd.straggler_report()`` must name rank 3, and only it, within 10 steps; rank 3 was last in nearly every
  decision, about 15 ms late on average; the non-members of a process set get a ValueError.
- ``balanced``: 10,000 steps without compute, every rank alike: nobody is ever named (checked every 100
  steps, and rank 0 logs no warning, which the test checks).
"""

import sys
import time

import numpy as np

import rvod.numpy as hvd
from _check import check, expect_error, finish, say

mode = sys.argv[1]
evens = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[evens])
rank = hvd.rank()
grads = [np.full(1024, rank, dtype=np.float32), np.full(64, rank, dtype=np.float64)]


def step(compute):
    handles = []
    for index, grad in enumerate(grads):
        time.sleep(compute / 2)
        handles.append(hvd.allreduce_async(grad, name=f"grad.{index}", op=hvd.Sum))
    for handle in handles:
        total = hvd.synchronize(handle)
        assert float(total[0]) == 6.0, total[:4]


def named():
    return sorted(r for r, record in hvd.straggler_report().items() if record["straggler"])


if mode == "slow":
    named_at = None
    for i in range(1, 21):
        step(0.060 if rank == 3 else 0.040)
        if named_at is None and named() == [3]:
            named_at = i
    report = hvd.straggler_report()
    say(f"rank {rank}: named at step {named_at}: {report}")
    with check("rank 3 is named within 10 steps, by every rank"):
        assert named_at is not None and named_at <= 10, named_at
        assert named() == [3], report
    with check("the report's fields, per global rank"):
        assert sorted(report) == [0, 1, 2, 3], report
        assert set(report[3]) == {"rounds", "times_last", "mean_lateness", "straggler"}, report[3]
        assert report[3]["rounds"] >= 36 and report[3]["times_last"] >= report[3]["rounds"] - 4, report[3]
        assert 0.008 <= report[3]["mean_lateness"] <= 0.06, report[3]
        for other in (0, 1, 2):
            assert report[other]["times_last"] <= 4 and report[other]["mean_lateness"] < 0.002, report[other]
    with check("a process set's report, or a ValueError for a non-member"):
        if rank in (0, 2):
            sub = hvd.straggler_report(evens)
            assert sorted(sub) == [0, 2] and sub[0]["rounds"] == 0, sub
        else:
            expect_error(ValueError, r"not a member of ProcessSet", hvd.straggler_report, evens)
else:
    ever_named = []
    for i in range(1, 10_001):
        step(0.0)
        if i % 100 == 0:
            ever_named.extend(named())
    report = hvd.straggler_report()
    say(f"rank {rank}: balanced: {report}")
    with check("nobody is named over 10,000 balanced steps"):
        assert ever_named == [] and named() == [], (ever_named, report)
        assert all(record["rounds"] >= 10_000 for record in report.values()), report
hvd.shutdown()
finish(rank)
