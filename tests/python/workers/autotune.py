"""Worker of test_autotune.py: STEPS training-like steps, each a burst of allreduces whose results are checked
exactly, while the autotuner changes the knobs underneath; then each rank writes OUT/rank<R>.json with the
values it applied (round by round, `_rvod.autotune_applied()`) and how many results were wrong.

usage: autotune.py OUT STEPS
"""

import json
import sys
from pathlib import Path

import numpy as np
import rvod.numpy as hvd
from rvod import _rvod

out, steps = Path(sys.argv[1]), int(sys.argv[2])
hvd.init()
R, N = hvd.rank(), hvd.size()
# Sizes of one step's tensors (float32 elements): small ones that fuse or travel eagerly, and larger ones.
SIZES = [1024] * 12 + [7, 4097, 65536, 262147]
wrong = []
for step in range(steps):
    handles = []
    for i, size in enumerate(SIZES):
        # Small integers: float32 sums of them are exact, so any mix-up shows.
        x = np.full(size, (R + 1) * (i + 1) + step % 7, np.float32)
        handles.append(hvd.allreduce_async(x, name=f"t{i}", op=hvd.Sum))
    for i, (size, handle) in enumerate(zip(SIZES, handles)):
        got = hvd.synchronize(handle)
        expected = sum((r + 1) * (i + 1) + step % 7 for r in range(N))
        if got.shape != (size,) or not np.all(got == expected):
            wrong.append([step, i])
(out / f"rank{R}.json").write_text(json.dumps({"applied": _rvod.autotune_applied(), "wrong": wrong}))
hvd.shutdown()
