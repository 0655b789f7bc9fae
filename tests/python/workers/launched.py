"""A rank of a job started by a launcher other than rvodrun (mpirun, torchrun, srun's or MPICH's variables).

Prints one line ``topology: {json}`` (what rvod says about this rank, and the launcher it detected) for the
test to compare with the launcher's placement, checks collectives with exact expected values, shuts down
and initializes again (the ranks meet anew), and ends with the usual verdict line. ``RVOD_TEST_COMM`` picks
how ``init`` is called: unset: ``init()``; ``world``: ``init(comm=MPI.COMM_WORLD)``; ``ranks:0,2``:
``init(comm=[0, 2])`` (other ranks do not call init); ``split``: ``init(comm=MPI.COMM_WORLD.Split(rank % 2))``.
"""

import json
import os
import sys

import numpy as np
import rvod.numpy as hvd
from _check import check, finish, say
from rvod import _rvod

launched = _rvod.launcher()
launcher = launched and launched[0]
mode = os.environ.get("RVOD_TEST_COMM")


def init_job():
    """hvd.init() as RVOD_TEST_COMM says; False when this process is not in the job."""
    if mode is None:
        hvd.init()
        return True
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if mode == "world":
        hvd.init(comm=world)
    elif mode.startswith("ranks:"):
        members = [int(r) for r in mode[len("ranks:"):].split(",")]
        if world.Get_rank() not in members:
            return False
        hvd.init(comm=members)
    elif mode == "split":
        hvd.init(comm=world.Split(world.Get_rank() % 2, world.Get_rank()))
    else:
        raise SystemExit(f"unknown RVOD_TEST_COMM={mode!r}")
    return True


if not init_job():
    print("world rank not in comm", flush=True)
    sys.exit(0)
R, N = hvd.rank(), hvd.size()
say("topology: " + json.dumps({
    "launcher": launcher, "rank": R, "size": N, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "transport": _rvod.transport_kind(),
    "mpi_enabled": hvd.mpi_enabled(), "mpi_built": hvd.mpi_built(),
}))

with check("allreduce Sum of float32"):
    got = hvd.allreduce(np.arange(10, dtype=np.float32) * (R + 1), op=hvd.Sum, name="sum")
    np.testing.assert_array_equal(got, np.arange(10, dtype=np.float32) * (N * (N + 1) // 2))

with check("allreduce Average of int64"):
    got = hvd.allreduce(np.full((3, 2), 2 * N * R, dtype=np.int64), op=hvd.Average, name="average")
    assert got.dtype == np.int64, got.dtype
    np.testing.assert_array_equal(got, np.full((3, 2), N * (N - 1), dtype=np.int64))

with check("allreduce Max of float64, 4097 elements"):
    got = hvd.allreduce(np.arange(4097, dtype=np.float64) + R, op=hvd.Max, name="max")
    np.testing.assert_array_equal(got, np.arange(4097, dtype=np.float64) + N - 1)

with check("allgather of a different number of rows per rank"):
    got = hvd.allgather(np.full((R + 1, 2), R, dtype=np.int32), name="gather")
    np.testing.assert_array_equal(got, np.concatenate([np.full((r + 1, 2), r, dtype=np.int32) for r in range(N)]))

with check("broadcast from the last rank"):
    got = hvd.broadcast(np.full(5, R, dtype=np.float64), root_rank=N - 1, name="bcast")
    np.testing.assert_array_equal(got, np.full(5, N - 1, dtype=np.float64))

with check("alltoall"):
    got = hvd.alltoall(np.arange(N, dtype=np.int32) + 100 * R, name="a2a")
    np.testing.assert_array_equal(got, np.array([100 * r + R for r in range(N)], dtype=np.int32))

with check("broadcast_object"):
    assert hvd.broadcast_object({"from": R}, root_rank=0) == {"from": 0}

hvd.barrier()
hvd.shutdown()

init_job()  # a second init after shutdown meets again: rank 0 serves a new store
with check("allreduce after shutdown and a second init"):
    assert (hvd.rank(), hvd.size()) == (R, N)
    got = hvd.allreduce(np.array([R + 1], dtype=np.int64), op=hvd.Sum, name="again")
    assert got.tolist() == [N * (N + 1) // 2], got
hvd.shutdown()
finish(R)
