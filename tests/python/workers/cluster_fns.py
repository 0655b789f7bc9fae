"""Functions that tests run on every rank of a Ray or Spark job (and, for the training, under rvodrun).

Each returns values for the test to compare with what it expects; the tests ship this module to the
cluster's workers by value (cloudpickle), so they need not import it.

As a script (``rvodrun -np 2 python cluster_fns.py OUT.npz``): the training, rank 0 saving its parameters.
"""

import os
import sys
import time


def collectives():
    """Every collective of rvod.numpy once, with values that depend on the rank; the raw results."""
    import numpy as np

    import rvod.numpy as hvd

    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        x = np.arange(4, dtype=np.float32) + r
        splits = np.full(n, 2, dtype=np.int32)
        out = {
            "topology": (r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()),
            "allreduce_sum": hvd.allreduce(x, op=hvd.Sum, name="sum"),
            "allreduce_average": hvd.allreduce(x, name="avg"),
            "allreduce_min": hvd.allreduce(x, op=hvd.Min, name="min"),
            "allreduce_max": hvd.allreduce(x, op=hvd.Max, name="max"),
            "allreduce_int64": hvd.allreduce(np.array([r + 1, 7], dtype=np.int64), op=hvd.Sum, name="int"),
            "grouped_allreduce": hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum, name="grouped"),
            "allgather": hvd.allgather(np.full((r + 1, 2), r, dtype=np.float64), name="gather"),
            "grouped_allgather": hvd.grouped_allgather([np.full(1, r, dtype=np.int32)] * 2, name="ggather"),
            "broadcast": hvd.broadcast(np.full(3, r, dtype=np.float32), root_rank=n - 1, name="bcast"),
            "alltoall": hvd.alltoall(np.arange(2 * n, dtype=np.float32) + 100 * r, splits=splits, name="a2a")[0],
            "reducescatter": hvd.reducescatter(np.ones((2 * n, 2), dtype=np.float32) * (r + 1), op=hvd.Sum,
                                               name="rs"),
            "broadcast_object": hvd.broadcast_object({"from": r}, root_rank=0),
            "allgather_object": hvd.allgather_object(("rank", r)),
        }
        hvd.barrier()
        return out
    finally:
        hvd.shutdown()


def expected_collectives(rank, n):
    """What ``collectives()`` returns on ``rank`` of ``n``, computed without any collective."""
    import numpy as np

    x = [np.arange(4, dtype=np.float32) + q for q in range(n)]
    return {
        "allreduce_sum": sum(x),
        "allreduce_average": sum(x) / n,
        "allreduce_min": x[0],
        "allreduce_max": x[-1],
        "allreduce_int64": np.array([n * (n + 1) // 2, 7 * n]),
        "grouped_allreduce": [sum(x), 2 * sum(x)],
        "allgather": np.concatenate([np.full((q + 1, 2), q, dtype=np.float64) for q in range(n)]),
        "grouped_allgather": [np.arange(n, dtype=np.int32)] * 2,
        "broadcast": np.full(3, n - 1, dtype=np.float32),
        "alltoall": np.concatenate([np.arange(2 * rank, 2 * rank + 2, dtype=np.float32) + 100 * q
                                    for q in range(n)]),
        "reducescatter": np.full((2, 2), n * (n + 1) / 2, dtype=np.float32),
        "broadcast_object": {"from": 0},
        "allgather_object": [("rank", q) for q in range(n)],
    }


def assert_collectives(results):
    """Every rank's ``collectives()`` results against ``expected_collectives`` (all ranks on one host)."""
    import numpy as np

    n = len(results)
    for rank, got in enumerate(results):
        assert got["topology"] == (rank, n, rank, n, 0, 1), (rank, got["topology"])
        for name, want in expected_collectives(rank, n).items():
            value = got[name]
            if isinstance(want, list) and want and isinstance(want[0], np.ndarray):
                assert len(value) == len(want), (rank, name)
                for v, w in zip(value, want):
                    np.testing.assert_allclose(v, w, err_msg=f"rank {rank}: {name}")
                    assert v.dtype == w.dtype, (rank, name, v.dtype, w.dtype)
            elif isinstance(want, np.ndarray):
                np.testing.assert_allclose(value, want, err_msg=f"rank {rank}: {name}")
                assert value.shape == want.shape, (rank, name, value.shape)
            else:
                assert value == want, (rank, name, value, want)


def train(steps=8):
    """A small MLP trained with DistributedOptimizer on a fixed batch split across ranks; rank's parameters."""
    import torch

    import rvod.torch as hvd

    hvd.init()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        data = torch.randn(24, 8)
        target = torch.randint(0, 3, (24,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        if hvd.rank() > 0:  # other starting points, which rank 0's broadcast must replace
            torch.manual_seed(1 + hvd.rank())
            for parameter in model.parameters():
                torch.nn.init.normal_(parameter)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters())
        shard = slice(hvd.rank() * 24 // hvd.size(), (hvd.rank() + 1) * 24 // hvd.size())
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(data[shard]), target[shard])
            loss.backward()
            optimizer.step()
        return [parameter.detach().numpy().copy() for parameter in model.parameters()]
    finally:
        hvd.shutdown()


def rvodrun_parameters(run_rvodrun, tmp_path):
    """``train()``'s parameters from a 2-rank rvodrun job (rank 0's)."""
    import numpy as np

    reference = tmp_path / "rvodrun.npz"
    result = run_rvodrun(["-np", "2", sys.executable, __file__, str(reference)], timeout=120)
    assert result.returncode == 0, result.stderr
    return list(np.load(reference).values())


def assert_same_parameters(per_rank, expected):
    import numpy as np

    for rank, parameters in enumerate(per_rank):
        assert len(parameters) == len(expected) == 4
        for got, want in zip(parameters, expected):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=f"rank {rank}")


def fail_on_rank_one():
    """Rank 1 raises; the others wait in a collective that rank 1 never joins."""
    import numpy as np

    import rvod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one fails on purpose")
    hvd.allreduce(np.ones(1), name="never.joined")
    time.sleep(600)
    return "unreachable"


def exit_on_rank_one():
    """Rank 1's process ends abruptly; the others wait."""
    import rvod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(3)
    time.sleep(600)
    return "unreachable"


if __name__ == "__main__":
    import numpy as np

    parameters = train()
    if int(os.environ.get("RVOD_RANK", "0")) == 0:
        np.savez(sys.argv[1], *parameters)
