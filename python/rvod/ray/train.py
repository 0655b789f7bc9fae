"""Ray Train integration: ``RvodConfig``, a ``ray.train.backend.BackendConfig`` for rvod collectives.

    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    from rvod.ray.train import RvodConfig

    trainer = DataParallelTrainer(train_loop, backend_config=RvodConfig(),
                                  scaling_config=ScalingConfig(num_workers=4))
    result = trainer.fit()          # train_loop calls hvd.init() and uses Ray Train's report/checkpoints

Ray Train creates, places and restarts the workers (its world ranks are their order); the backend gives each
worker its rvod topology from the nodes Ray placed them on, serves the rendezvous store in world rank 0 and
hands the secret to every worker through Ray. Ray's Backend API is a developer API: it may change between
Ray versions (tested with the version named in the README).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

from rvod.runner import cluster_job

# World rank 0's store, kept in that worker's process between on_start and on_shutdown.
_hosted: cluster_job.HostedStore | None = None


@dataclass
class RvodConfig(BackendConfig):
    """``timeout_s``: how long ranks wait for each other in ``hvd.init()``; ``nics``: network interfaces."""

    timeout_s: float = 60
    nics: tuple[str, ...] | None = None

    @property
    def backend_cls(self):
        return _RvodBackend


def _place() -> tuple[str, str, str]:
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), socket.gethostname()


def _serve_store(address: str, secret: bytes) -> int:
    global _hosted
    _hosted = cluster_job.HostedStore(address, secret)
    return _hosted.port


def _leave() -> None:
    """Stop this worker's engine if the training loop left it running; world rank 0 closes the store."""
    global _hosted
    from rvod.common import basics

    if basics.is_initialized():
        basics.shutdown()
    if _hosted is not None:
        _hosted.close()
        _hosted = None


class _RvodBackend(Backend):
    def on_start(self, worker_group, backend_config: RvodConfig) -> None:
        places = worker_group.execute(_place)
        hosts = [f"{hostname}/{node[:8]}" for node, _, hostname in places]
        slots = cluster_job.slots_for_hosts(hosts)
        address = cluster_job.store_address(hosts, places[0][1])
        secret = cluster_job.new_secret()
        port = worker_group.execute_single(0, _serve_store, address, secret)
        settings = {"RVOD_START_TIMEOUT": str(backend_config.timeout_s)}
        if backend_config.nics:
            settings["RVOD_NETWORK_INTERFACE"] = ",".join(backend_config.nics)
        several_hosts = len(set(hosts)) > 1
        for index, (slot, (_, node_address, _)) in enumerate(zip(slots, places, strict=True)):
            env = cluster_job.rank_env(slot, address=address, port=port, secret=secret, settings=settings)
            if several_hosts and not backend_config.nics:
                env["RVOD_IFACE_ADDR"] = node_address
            worker_group.execute_single(index, cluster_job.apply_env, env)

    def on_shutdown(self, worker_group, backend_config: RvodConfig) -> None:
        worker_group.execute(_leave)
