"""Worker of test_timeline_endings.py: ROUNDS rounds of an allreduce and an allgather while the timeline
records (RVOD_TIMELINE), then the job ends in one of these ways:

kill       rank 1 SIGKILLs itself instead of starting the next round (rank 0 then fails, and rvodrun
           sends it SIGTERM)
raise      rank 1 raises an unhandled exception instead of starting the next round
sigterm    after a barrier, rank 0 sends rvodrun SIGTERM (rvodrun passes it to every rank); both wait for it
exit       both ranks return from the script without calling shutdown()
"""

import os
import signal
import sys
import time

import numpy as np
import rvod.numpy as hvd

mode, rounds = sys.argv[1], int(sys.argv[2])
hvd.init()
R = hvd.rank()
for i in range(rounds):
    hvd.allreduce(np.ones(64, np.float32), name=f"ar.{i}", op=hvd.Sum)
    hvd.allgather(np.ones((R + 1, 3), np.float32), name=f"ag.{i}")
if mode == "kill" and R == 1:
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "raise" and R == 1:
    raise RuntimeError("rank 1 gives up")
elif mode == "sigterm":
    hvd.barrier()  # both ranks' rounds are recorded (an op is recorded before its caller gets the result)
    if R == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)
elif mode in ("kill", "raise"):
    hvd.allreduce(np.ones(64, np.float32), name=f"ar.{rounds}", op=hvd.Sum)  # fails: rank 1 is gone
