"""Worker of test_autotune.py: STEPS training-like steps, each a burst of allreduces whose results are checked
exactly, while the autotuner changes the knobs underneath; then each rank writes OUT/rank<R>.json with the
values it applied (round by round, `_rvod.autotune_applied()`) and how many results were wrong.

With `by-hand` (autotune off): for each of three settings in turn, every rank calls the private hook
`_rvod._set_tuned_values` at the same step (rank 1 with other values: only rank 0's count), then runs STEPS
steps; the JSON also holds the length of the applied list after each setting's first and second step, and
the ValueError texts of bad cycle times.

usage: autotune.py OUT STEPS [by-hand]
"""

import json
import sys
from pathlib import Path

import numpy as np
import rvod.numpy as hvd
from rvod import _rvod

out, steps, by_hand = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:4] == ["by-hand"]
hvd.init()
R, N = hvd.rank(), hvd.size()
# Sizes of one step's tensors (float32 elements): small ones that fuse or travel eagerly, and larger ones.
SIZES = [1024] * 12 + [7, 4097, 65536, 262147]
# (fusion threshold bytes, cycle time ms, cache on) set by hand.
SETTINGS = [(1 << 20, 0.2, True), (0, 5.0, False), (64 << 20, 1.0, True)]
wrong, seen, errors = [], [], []


def burst(step, tag):
    handles = []
    for i, size in enumerate(SIZES):
        # Small integers: float32 sums of them are exact, so any mix-up shows.
        x = np.full(size, (R + 1) * (i + 1) + step % 7, np.float32)
        handles.append(hvd.allreduce_async(x, name=f"t{i}", op=hvd.Sum))
    for i, (size, handle) in enumerate(zip(SIZES, handles)):
        got = hvd.synchronize(handle)
        expected = sum((r + 1) * (i + 1) + step % 7 for r in range(N))
        if got.shape != (size,) or not np.all(got == expected):
            wrong.append([*tag, step, i])


if not by_hand:
    for step in range(steps):
        burst(step, [])
else:
    for setting, (fusion, cycle_ms, cache) in enumerate(SETTINGS):
        if R == 0:
            _rvod._set_tuned_values(fusion, cycle_ms, cache)
        else:
            _rvod._set_tuned_values(fusion + 4096, cycle_ms * 2, not cache)
        for step in range(steps):
            burst(step, [setting])
            if step in (0, 1):
                seen.append(len(_rvod.autotune_applied()))
    for bad in (-1.0, float("nan"), float("inf")):
        try:
            _rvod._set_tuned_values(1024, bad, True)
        except ValueError as e:
            errors.append(str(e))
(out / f"rank{R}.json").write_text(json.dumps({"applied": _rvod.autotune_applied(), "wrong": wrong, "seen": seen,
                                               "errors": errors}))
hvd.shutdown()
