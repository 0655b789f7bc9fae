"""rvod.ray.RayExecutor on a local Ray cluster this module starts (``ray.init(num_cpus=3)``, without token
authentication like every Ray cluster of the tests: see conftest.ray_token_auth_disabled): every op on 2
and 3 workers, torch training equal to rvodrun's, failures named by rank, and a run after a failure."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="rvod.ray needs Ray (pip install ray) to be tested")

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import cluster_fns  # noqa: E402
from conftest import ray_token_auth_disabled  # noqa: E402

from rvod.ray import RayExecutor  # noqa: E402

# Ray's workers cannot import the tests' modules: functions and classes from them travel by value.
ray.cloudpickle.register_pickle_by_value(cluster_fns)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def local_ray():
    with ray_token_auth_disabled():
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
        yield
        ray.shutdown()


def started(workers: int, **start) -> RayExecutor:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=workers)
    executor.start(**start)
    return executor


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 3])
def test_every_op_gives_the_right_values(local_ray, workers):
    executor = started(workers)
    try:
        cluster_fns.assert_collectives(executor.run(cluster_fns.collectives))
        # A second job on the same workers meets again (the engine shut down at the end of the first).
        cluster_fns.assert_collectives(executor.run(cluster_fns.collectives))
    finally:
        executor.shutdown()


@pytest.mark.timeout(240)
def test_training_matches_rvodrun(local_ray, run_rvodrun, tmp_path):
    expected = cluster_fns.rvodrun_parameters(run_rvodrun, tmp_path)
    executor = started(2)
    try:
        cluster_fns.assert_same_parameters(executor.run(cluster_fns.train), expected)
    finally:
        executor.shutdown()


class Counter:
    """An executable: ``start(executable_cls=Counter, ...)`` creates one in every worker."""

    def __init__(self, start, step=1):
        self.value, self.step = start, step

    def bump(self):
        self.value += self.step
        return self.value


@pytest.mark.timeout(120)
def test_execute_and_run_remote(local_ray):
    executor = started(2, executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5},
                       extra_env_vars={"RVOD_TEST_MARK": "set by start"})
    try:
        assert executor.execute(lambda counter: counter.bump()) == [15, 15]
        assert executor.execute_single(lambda counter: counter.bump()) == 20
        assert executor.execute(lambda counter: counter.value) == [20, 15]
        refs = executor.run_remote(lambda a, b: (__import__("os").environ["RVOD_TEST_MARK"], a + b), args=[1],
                                   kwargs={"b": 2})
        assert ray.get(refs) == [("set by start", 3)] * 2
        env = executor.run(lambda: {k: __import__("os").environ[k] for k in ("RVOD_RANK", "RVOD_SIZE",
                                                                               "RVOD_LOCAL_RANK")})
        assert env == [{"RVOD_RANK": str(r), "RVOD_SIZE": "2", "RVOD_LOCAL_RANK": str(r)} for r in range(2)]
    finally:
        executor.shutdown()


@pytest.mark.timeout(180)
def test_a_failing_rank_is_named_and_the_executor_starts_again(local_ray):
    executor = started(2)
    with pytest.raises(RuntimeError) as failure:
        executor.run(cluster_fns.fail_on_rank_one)
    message = str(failure.value)
    assert re.search(r"^rvod\.ray: rank 1 on \S+ failed: rank 1 raised:", message), message
    assert "Traceback (most recent call last)" in message and "ValueError: rank one fails on purpose" in message
    assert "call start() to run again" in message
    assert executor.workers == [], "every worker is stopped, rank 0 included (it waited in a collective)"
    with pytest.raises(RuntimeError, match="not started"):
        executor.run(cluster_fns.collectives)
    executor.start()
    try:
        cluster_fns.assert_collectives(executor.run(cluster_fns.collectives))
    finally:
        executor.shutdown()


@pytest.mark.timeout(180)
def test_a_dead_worker_actor_is_named(local_ray):
    executor = started(2)
    with pytest.raises(RuntimeError, match=r"rvod\.ray: rank 1 on \S+ \([0-9.]+\) failed: its worker actor died") as failure:
        executor.run(cluster_fns.exit_on_rank_one)
    assert "call start() to run again" in str(failure.value)
    executor.start()
    try:
        assert executor.run(lambda: 7) == [7, 7]
    finally:
        executor.shutdown()


def test_arguments_are_checked_before_anything_starts():
    settings = RayExecutor.create_settings(timeout_s=5)
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="num_workers must be a positive integer"):
        RayExecutor(settings, num_workers=0)
    executor = RayExecutor(settings, num_hosts=2, num_workers_per_host=3, cpus_per_worker=2)
    bundles, strategy, bundle_of = executor._bundles()
    assert (bundles, strategy, bundle_of) == ([{"CPU": 6}, {"CPU": 6}], "STRICT_SPREAD", [0, 0, 0, 1, 1, 1])
    assert settings.engine_env() == {"RVOD_START_TIMEOUT": "5"}


def _train_loop(config):
    """Writes what rvod gave this worker to a file per rank (every worker of the test runs on this machine)."""
    import json

    import numpy as np
    import ray.train

    import rvod.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="train.sum")
    seen = {"sum": float(total[0]), "topology": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()],
            "ray_rank": ray.train.get_context().get_world_rank()}
    (Path(config["out"]) / f"rank{hvd.rank()}.json").write_text(json.dumps(seen))
    hvd.shutdown()


@pytest.mark.timeout(240)
def test_ray_train_runs_rvod_collectives_through_rvod_config(local_ray, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from rvod.ray.train import RvodConfig

    import json

    trainer = DataParallelTrainer(_train_loop, train_loop_config={"out": str(tmp_path)},
                                  backend_config=RvodConfig(timeout_s=30), scaling_config=ScalingConfig(num_workers=2),
                                  run_config=RunConfig(storage_path=str(tmp_path / "storage"), name="rvod"))
    result = trainer.fit()
    assert result.error is None, result.error
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert seen == [{"sum": 3.0, "topology": [rank, 2, rank, 2], "ray_rank": rank} for rank in range(2)]
