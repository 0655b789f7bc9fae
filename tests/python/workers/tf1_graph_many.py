"""Many collectives in one Session.run of a tf.compat.v1 graph (eager execution disabled, as a Horovod TF1
script runs), 2 ranks through rvodrun: 1, 8, 16, 64 and 256 allreduces (float32) and allgathers (int32),
mixed, fetched together, in a Session created plainly and in Sessions with inter_op_parallelism_threads=1 and
2; then a collective that one rank submits late, which the stall inspector names (the test reads rank 0's
warning). Each collective used to hold one of the Session's inter-op threads while it waited for the other
rank, so more of them than the Session had threads deadlocked.

Argument: seconds after which a rank that is still running prints every thread's stack and exits (a hang
inside Session.run cannot be interrupted otherwise).
"""

import faulthandler
import sys
import time

faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _check import check, finish  # noqa: E402

import rvod.tensorflow as hvd  # noqa: E402

tf.compat.v1.disable_eager_execution()
hvd.init()
R, N = hvd.rank(), hvd.size()
assert N >= 2, "run with at least 2 ranks"

COUNTS = [1, 8, 16, 64, 256]
SHAPE = (17, 17)


def collectives(count):
    """``count`` collectives, alternately an allreduce and an allgather, each with its own values, and what
    each must return."""
    outputs, expected = [], []
    for i in range(count):
        if i % 2 == 0:
            outputs.append(hvd.allreduce(tf.fill(SHAPE, float(i * N + R)), op=hvd.Sum, name=f"many{count}.{i}"))
            expected.append(np.full(SHAPE, sum(float(i * N + r) for r in range(N)), np.float32))
        else:
            outputs.append(hvd.allgather(tf.fill(SHAPE, i * N + R), name=f"many{count}.{i}"))
            expected.append(np.concatenate([np.full(SHAPE, i * N + r, np.int32) for r in range(N)]))
    return outputs, expected


GRAPHS = {count: collectives(count) for count in COUNTS}
CONFIGS = {
    "a plain Session": None,
    "inter_op_parallelism_threads=1": tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1),
    "inter_op_parallelism_threads=2": tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2),
}

for label, config in CONFIGS.items():
    with tf.compat.v1.Session(config=config) as session:
        for count, (outputs, expected) in GRAPHS.items():
            with check(f"{count} allreduces and allgathers in one Session.run, {label}"):
                start = time.monotonic()
                got = session.run(outputs)
                print(f"{count} {label}: {time.monotonic() - start:.2f} s", file=sys.stderr)
                assert len(got) == count
                for i, (value, want) in enumerate(zip(got, expected)):
                    assert value.dtype == want.dtype and np.array_equal(value, want), (i, value, want)


# Rank 1 computes the input of this allreduce slowly, so rank 0's allreduce waits for it in Session.run past
# RVOD_STALL_CHECK_TIME_SECONDS: rank 0 (the coordinator) warns naming the tensor and rank 1; then it completes.
def slowly(x):
    time.sleep(4.5)
    return x


value = tf.fill([3], float(R + 1))
if R == 1:
    value = tf.py_function(slowly, [value], tf.float32)
stalled = hvd.allreduce(value, op=hvd.Sum, name="tf1.stall")
with tf.compat.v1.Session(config=CONFIGS["inter_op_parallelism_threads=1"]) as session:
    with check("a collective one rank submits late completes"):
        got = session.run(stalled)
        assert np.array_equal(got, np.full(3, sum(r + 1 for r in range(N)), np.float32)), got

hvd.shutdown()
finish(R)
