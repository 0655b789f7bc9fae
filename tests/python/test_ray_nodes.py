"""rvod.ray on a Ray cluster of two nodes on this machine (``ray start --head`` and ``ray start --address``,
started by this module): one bundle per node (``num_hosts=2``), ranks, local ranks and cross ranks from the
node Ray placed each worker on, and collectives across the two nodes (TCP between them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="rvod.ray needs Ray (pip install ray) to be tested")

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import JOB_TAG_VARIABLE, kill_tagged, ray_token_auth_disabled  # noqa: E402

from rvod.ray import RayExecutor  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    tag = uuid.uuid4().hex
    port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", **{JOB_TAG_VARIABLE: tag})  # see ray_token_auth_disabled
    common = ["--block", "--num-cpus=2", "--disable-usage-stats"]
    head = subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                             f"--temp-dir={tmp_path_factory.mktemp('ray')}", *common], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nodes = [head]
    try:
        deadline = time.monotonic() + 90
        while True:  # the head's GCS answers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and head.poll() is None, "ray start --head did not come up"
                time.sleep(0.5)
        nodes.append(subprocess.Popen([RAY, "start", f"--address=127.0.0.1:{port}", *common], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with ray_token_auth_disabled():
            ray.init(address=f"127.0.0.1:{port}", log_to_driver=False, configure_logging=False)
            try:
                while len([node for node in ray.nodes() if node["Alive"]]) < 2:
                    assert time.monotonic() < deadline, "the second Ray node did not join"
                    time.sleep(0.5)
                yield
            finally:
                ray.shutdown()
    finally:
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        kill_tagged(tag)


def _topology_and_values():
    import numpy as np

    import rvod.numpy as hvd

    hvd.init()
    try:
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="sum")
        gathered = hvd.allgather(np.array([hvd.rank()]), name="gather")
        root = hvd.broadcast(np.array([hvd.rank() * 10]), root_rank=3, name="bcast")
        return ((hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()),
                float(total[0]), gathered.tolist(), int(root[0]))
    finally:
        hvd.shutdown()


@pytest.mark.timeout(240)
def test_workers_of_a_node_are_its_local_ranks_and_collectives_cross_nodes(two_nodes):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2, num_workers_per_host=2)
    executor.start()
    try:
        results = executor.run(_topology_and_values)
        nodes = ray.get([worker.place.remote() for worker in executor.workers])
    finally:
        executor.shutdown()
    assert [node for node, _, _ in nodes][:2] == [nodes[0][0]] * 2 and nodes[2][0] == nodes[3][0] != nodes[0][0]
    topologies = [result[0] for result in results]
    assert topologies == [(0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2), (3, 4, 1, 2, 1, 2)]
    assert [result[1:] for result in results] == [(10.0, [0, 1, 2, 3], 30)] * 4
