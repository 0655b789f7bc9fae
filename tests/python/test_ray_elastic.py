"""rvod.ray.ElasticRayExecutor on a real Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster:
a head and a second raylet, 1 CPU each, so one worker per node): the second node is killed mid-training
and a third node added (``ray start --address``); the job goes on at 1 rank, grows back to 2, finishes,
and returns every rank's values, equal on every rank. The driver learns of the training through
ray_logger and a callback; the callback is what kills and adds the nodes, at steps the training reached.
First, on the same cluster: a function that raises on every worker fails the job with its traceback, and
ray_logger's values reach RayExecutor.run's callbacks, fixed and elastic (``min_workers``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="rvod.ray needs Ray (pip install ray) to be tested")

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import JOB_TAG_VARIABLE, kill_tagged, ray_token_auth_disabled  # noqa: E402

from rvod.ray import ElasticRayExecutor, RayExecutor  # noqa: E402

# Ray's workers cannot import the tests' modules: functions from this one travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
MAX_STEPS = 600
STEP_SECONDS = 0.05
RAY = str(Path(sys.executable).parent / "ray")


class _Cluster:
    """The test's cluster: ``ray.cluster_utils.Cluster``'s nodes, and nodes added by ``ray start`` (Cluster
    adds nodes only from the main thread, which runs the executor)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.tag = uuid.uuid4().hex
        self.started: list[subprocess.Popen] = []

    def kill_second_node(self) -> None:
        self.cluster.remove_node(self.cluster.list_all_nodes()[1], allow_graceful=False)

    def add_node(self) -> None:
        env = dict(os.environ, RAY_AUTH_MODE="disabled", **{JOB_TAG_VARIABLE: self.tag})
        self.started.append(subprocess.Popen(
            [RAY, "start", f"--address={self.cluster.address}", "--num-cpus=1", "--block", "--disable-usage-stats"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def stop_added(self) -> None:
        for node in self.started:
            os.killpg(node.pid, signal.SIGTERM)
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        kill_tagged(self.tag)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with ray_token_auth_disabled():
        # A killed node counts as dead after about a second (Ray's default is many seconds).
        config = {"health_check_period_ms": 200, "health_check_failure_threshold": 3,
                  "health_check_initial_delay_ms": 0}
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "_system_config": config})
        nodes = _Cluster(cluster)
        try:
            cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            cluster.wait_for_nodes(timeout=60)
            yield nodes
        finally:
            ray.shutdown()
            nodes.stop_added()
            cluster.shutdown()


def _train():
    """Counts, at every step, the world's size with an allreduce, committing after each step, until the
    world has been 2 ranks, then 1, then 2 again for 5 steps. Returns what every rank saw."""
    import numpy as np

    import rvod.numpy as hvd
    from rvod.common import basics, elastic
    from rvod.ray import ray_logger

    def train(state):
        while state.step < MAX_STEPS:
            size = hvd.size()
            if not state.runs or state.runs[-1][0] != size:
                state.runs.append([size, 0])
            if [run[0] for run in state.runs] == [2, 1, 2] and state.runs[-1][1] >= 5:
                break
            counted = hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="count")
            state.total += float(counted[0])
            state.runs[-1][1] += 1
            state.step += 1
            ray_logger.log({"step": state.step, "size": size})
            time.sleep(STEP_SECONDS)
            state.commit()

    hvd.init()
    state = elastic.ObjectState(step=0, total=0.0, runs=[])
    # hvd.elastic.run without a framework: rvod.common.elastic's run loop, resetting the engine.
    elastic.run_fn(train, lambda: elastic.reset_engine(basics.shutdown, basics.init))(state)
    result = {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "total": state.total, "runs": state.runs}
    hvd.shutdown()
    return result


def _raise():
    import rvod.numpy as hvd

    hvd.init()
    raise ValueError(f"bad input on rank {hvd.rank()}")


@pytest.mark.timeout(60)
def test_a_function_raising_on_every_worker_fails_the_job_with_its_traceback(cluster):
    executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=2, elastic_timeout=30))
    executor.start()
    try:
        with pytest.raises(RuntimeError) as raised:
            executor.run(_raise)
    finally:
        executor.shutdown()
    message = str(raised.value)
    assert "the elastic job failed" in message and "is blacklisted" in message, message
    assert re.search(r"rank [01] raised:\n.*ValueError: bad input on rank [01]", message, re.S), message


def _logging_sum(scale):
    import numpy as np

    import rvod.numpy as hvd
    from rvod.ray import ray_logger

    hvd.init()
    ray_logger.log({"rank": hvd.rank(), "size": hvd.size()})  # rank 0 only
    ray_logger.log({"every": hvd.rank()}, chief_only=False)
    total = float(hvd.allreduce(np.array([scale * (hvd.rank() + 1.0)]), op=hvd.Sum, name="sum")[0])
    hvd.shutdown()
    return total


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [{"num_workers": 2}, {"min_workers": 1, "max_workers": 2}], ids=["fixed", "elastic"])
def test_ray_executor_run_calls_back_with_what_ranks_log(cluster, mode):
    logged = []
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), cpus_per_worker=1, **mode)
    executor.start()
    try:
        results = executor.run(_logging_sum, kwargs={"scale": 10}, callbacks=[logged.append])
    finally:
        executor.shutdown()
    assert results == [30.0, 30.0]
    assert {"rank": 0, "size": 2} in logged
    assert sorted(item["every"] for item in logged if "every" in item) == [0, 1] and len(logged) == 3


@pytest.mark.timeout(180)
def test_a_killed_node_shrinks_the_job_and_an_added_node_grows_it_back(cluster):
    logged, changes = [], []

    def steer(info):
        """Kills the second node once 2 ranks trained 5 steps; adds a node once 1 rank trained 5 steps."""
        logged.append(info)
        at_size = sum(1 for item in logged if item["size"] == info["size"])
        if info["size"] == 2 and at_size == 5 and not changes:
            changes.append("killed")
            cluster.kill_second_node()
        elif info["size"] == 1 and at_size == 5 and changes == ["killed"]:
            changes.append("added")
            cluster.add_node()

    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2, elastic_timeout=60, timeout_s=30)
    executor = ElasticRayExecutor(settings, cpus_per_worker=1)
    executor.start()
    try:
        results = executor.run(_train, callbacks=[steer])
    finally:
        executor.shutdown()

    assert changes == ["killed", "added"]
    assert [result["rank"] for result in results] == [0, 1] and {result["size"] for result in results} == {2}
    first = results[0]
    assert [size for size, _ in first["runs"]] == [2, 1, 2] and first["step"] < MAX_STEPS, first
    # Every committed step counted the ranks of its world once: no step lost or counted twice on a restore.
    assert first["total"] == sum(size * steps for size, steps in first["runs"])
    assert first["step"] == sum(steps for _, steps in first["runs"])
    assert results[1] == {**first, "rank": 1}
    # What the driver was told: the sizes rank 0 logged, step after step.
    sizes = [item["size"] for item in logged]
    assert [item["step"] for item in logged][-1] == first["step"] and sizes[0] == 2 and sizes[-1] == 2 and 1 in sizes


def test_settings_take_horovods_names_and_refuse_contradictions():
    settings = ElasticRayExecutor.create_settings(min_workers=2, max_workers=4, cooldown_range=(1, 5), nics="eth0")
    assert (settings.min_num_proc, settings.max_num_proc, settings.cooldown_range) == (2, 4, (1, 5))
    assert settings.engine_env()["RVOD_NETWORK_INTERFACE"] == "eth0"
    with pytest.warns(DeprecationWarning, match="min_np and max_np are deprecated"):
        assert ElasticRayExecutor.create_settings(min_np=3).min_num_proc == 3
    with pytest.raises(ValueError, match="give one of min_num_proc, min_np, not several"):
        ElasticRayExecutor.create_settings(min_num_proc=2, min_np=3)
    with pytest.raises(ValueError, match="max_num_proc one >= min_num_proc, got 3 and 2"):
        ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2)
    with pytest.raises(ValueError, match="use_gpu is False"):
        ElasticRayExecutor(settings, gpus_per_worker=1)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)  # Horovod's older name
    assert executor.settings.discovery.cpus_per_worker == 2
    with pytest.raises(RuntimeError, match="not started; call start"):
        executor.run(lambda: None)


def test_discovery_counts_the_slots_of_alive_nodes(monkeypatch):
    def node(node_id, alive, **resources):
        return {"NodeID": node_id, "NodeManagerHostname": "box", "NodeManagerAddress": "10.0.0.1",
                "Alive": alive, "Resources": resources}

    nodes = [node("aaaaaaaa11", True, CPU=4.0, GPU=1.0), node("bbbbbbbb22", False, CPU=8.0),
             node("cccccccc33", True, CPU=3.0), node("dddddddd44", True, CPU=1.0)]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    from rvod.ray import RayHostDiscovery

    assert RayHostDiscovery(cpus_per_worker=2).find_available_hosts_and_slots() == {"box/aaaaaaaa": 2, "box/cccccccc": 1}
    assert RayHostDiscovery(use_gpu=True, cpus_per_worker=1).find_available_hosts_and_slots() == {"box/aaaaaaaa": 1}
