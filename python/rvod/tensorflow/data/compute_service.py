"""tf.data service dispatchers and workers run by a compute job beside the training job, as Horovod's
``horovod.tensorflow.data.compute_service``.

The compute job (``python -m rvod.tensorflow.data.compute_worker``) starts the compute service and writes a
``TfDataServiceConfig`` file; each of its ranks runs ``compute_worker_fn``: one tf.data worker, and for the
first rank of each group of ``workers_per_dispatcher`` a dispatcher too (``dispatcher_side='compute'``).
With ``dispatcher_side='training'`` the training ranks start the dispatchers inside ``tf_data_service``.
A training rank reads the config and either calls ``dataset.send_to_data_service(config, rank, size)``
(compute-side dispatchers) or distributes its dataset itself inside ``with tf_data_service(config, rank)``.

Addresses are the loopback address unless the config names a NIC (``dispatchers_nic``). Waits for the
service, its dispatchers and workers end after ``config.timeout`` seconds with a ``ComputeServiceError``.
Once a rank has used the service, ``exit_if_lost`` ends the process with a message naming the service if the
service goes away before someone asked it to shut down: the tf.data service client retries a dead dispatcher
forever, and an error is better than a job that hangs.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tensorflow as tf

from rvod.runner import network
from rvod.runner.compute_service import ComputeClient, ComputeServiceError, ComputeServiceTimeout, exit_if_lost

__all__ = ["TfDataServiceConfig", "tf_data_service", "send_to_data_service", "start_and_register_dispatcher",
           "compute_worker_fn", "ComputeServiceError", "ComputeServiceTimeout"]

DISPATCHER_SIDES = ("compute", "training")
_CONFIG_POLL_SECONDS = 0.1
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TfDataServiceConfig:
    """What a training job needs to find the compute job's tf.data service: its shape, where the dispatchers
    run, the compute service's addresses and secret ``key``, and the ``timeout`` of every wait (seconds)."""

    dispatchers: int
    dispatchers_work_dir: str | None
    dispatchers_nic: str | None
    workers_per_dispatcher: int
    dispatcher_side: str
    addresses: Mapping[str, Sequence[tuple[str, int]]]
    key: bytes
    timeout: int = 60

    def __post_init__(self):
        if self.dispatcher_side not in DISPATCHER_SIDES:
            raise ValueError(f"Unsupported dispatcher side: {self.dispatcher_side!r} (use 'compute' or 'training')")
        if self.dispatchers <= 0 or self.workers_per_dispatcher <= 0:
            raise ValueError(f"dispatchers ({self.dispatchers}) and workers_per_dispatcher "
                             f"({self.workers_per_dispatcher}) must be larger than 0")

    def compute_client(self, verbose=1) -> ComputeClient:
        return ComputeClient(self.addresses, self.key, verbose=verbose, timeout=self.timeout)

    def to_dict(self) -> Mapping[str, Any]:
        config = dataclasses.asdict(self)
        config["key"] = binascii.hexlify(self.key).decode()
        config["addresses"] = {nic: [[host, port] for host, port in addrs] for nic, addrs in self.addresses.items()}
        return config

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> TfDataServiceConfig:
        return TfDataServiceConfig(
            dispatchers=config["dispatchers"],
            dispatchers_work_dir=config.get("dispatchers_work_dir"),
            dispatchers_nic=config.get("dispatchers_nic"),
            workers_per_dispatcher=config["workers_per_dispatcher"],
            dispatcher_side=config["dispatcher_side"],
            addresses={nic: [(addr[0], addr[1]) for addr in addrs] for nic, addrs in config["addresses"].items()},
            key=binascii.unhexlify(config["key"]),
            timeout=config.get("timeout", 60),
        )

    def write(self, filename: str):
        """Writes the config as JSON; readers never see a partial file (it is renamed into place)."""
        path = Path(filename)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as w:
            json.dump(self.to_dict(), w)
        os.chmod(w.name, 0o600)  # the file holds the service's secret
        os.replace(w.name, path)

    @staticmethod
    def read(filename: str, wait_for_file_creation: bool = False, timeout: float = 60) -> TfDataServiceConfig:
        """Reads a config file; with ``wait_for_file_creation``, waits up to ``timeout`` seconds for the compute
        job to write it (``ComputeServiceTimeout`` after that)."""
        deadline = time.monotonic() + timeout
        while wait_for_file_creation and not os.path.exists(filename):
            if time.monotonic() > deadline:
                raise ComputeServiceTimeout(
                    f"no compute service config file at {filename} after {timeout:g} s: start the compute job first "
                    f"(rvodrun -np N python -m rvod.tensorflow.data.compute_worker {filename})")
            time.sleep(_CONFIG_POLL_SECONDS)
        with open(filename) as r:
            return TfDataServiceConfig.from_dict(json.load(r))


def _service_host(dispatchers_nic: str | None) -> str:
    return network.interface_address(dispatchers_nic) if dispatchers_nic else network.LOOPBACK


@contextmanager
def tf_data_service(compute_config: TfDataServiceConfig, rank: int):
    """Yields the address of the tf.data dispatcher training rank ``rank`` uses, once the dispatcher and all of
    its workers registered. With ``dispatcher_side='training'`` this rank starts that dispatcher (rank 0 the
    only one when there is one dispatcher) and stops it on leaving."""
    compute = compute_config.compute_client(verbose=2)
    exit_if_lost(compute_config.addresses, compute_config.key, compute_config.timeout)
    dispatcher_server = None
    dispatcher_id = rank if compute_config.dispatchers > 1 else 0
    try:
        if compute_config.dispatcher_side == "training" and (compute_config.dispatchers > 1 or rank == 0):
            dispatcher_server = start_and_register_dispatcher(compute_config.dispatchers, rank,
                                                              compute_config.dispatchers_work_dir,
                                                              compute_config.dispatchers_nic, compute)
        dispatcher_address = compute.wait_for_dispatcher_registration(dispatcher_id, compute_config.timeout)
        compute.wait_for_dispatcher_worker_registration(dispatcher_id, compute_config.timeout)
        yield dispatcher_address
    finally:
        compute.close()
        if dispatcher_server is not None:
            dispatcher_server.stop()
            _log.info("Dispatcher %d shut down", dispatcher_id)


def send_to_data_service(dataset: tf.data.Dataset, compute_config: TfDataServiceConfig, rank: int,
                         size: int | None = None, processing_mode: str = "distributed_epoch",
                         reuse_dataset: bool = False, round_robin: bool = False) -> tf.data.Dataset:
    """``dataset`` processed by the compute job's tf.data workers: every transformation before this call runs
    there, every one after it here. Each rank gets its own job over the whole dataset unless ``reuse_dataset``
    (one dispatcher): then the ranks share one job, first come first served, or round robin with
    ``round_robin`` (which needs ``size`` and an endless dataset)."""
    if compute_config.dispatcher_side == "training":
        raise RuntimeError("training side dispatcher not supported, use tf_data_service context manager instead")
    if reuse_dataset and round_robin and size is None:
        raise ValueError("round_robin needs size, the number of training ranks")
    with tf_data_service(compute_config, rank) as dispatcher_address:
        return dataset.apply(tf.data.experimental.service.distribute(
            processing_mode=processing_mode,
            service=dispatcher_address,
            job_name="job" if reuse_dataset else None,
            consumer_index=rank if reuse_dataset and round_robin else None,
            num_consumers=size if reuse_dataset and round_robin else None))


tf.data.Dataset.send_to_data_service = send_to_data_service


def start_and_register_dispatcher(dispatchers: int, dispatcher_index: int, work_dir_root: str | None,
                                  dispatcher_nic: str | None,
                                  compute: ComputeClient) -> tf.data.experimental.service.DispatchServer:
    """Starts a tf.data dispatcher (fault tolerant, keeping its journal under ``work_dir_root``, when given)
    and registers its address as dispatcher ``dispatcher_index``."""
    _log.info("Setting up Dispatcher for %s", "all tasks" if dispatchers == 1 else f"task {dispatcher_index}")
    work_dir = str(Path(work_dir_root).resolve() / f"dispatcher-{dispatcher_index}") if work_dir_root else None
    server = tf.data.experimental.service.DispatchServer(tf.data.experimental.service.DispatcherConfig(
        work_dir=work_dir, fault_tolerant_mode=work_dir is not None))
    # server.target names localhost; other ranks need the address of the NIC the service is reached by.
    port = int(server.target.rsplit(":", 1)[1])
    target = f"grpc://{_service_host(dispatcher_nic)}:{port}"
    compute.register_dispatcher(dispatcher_index, target)
    _log.info("Registered Dispatcher %d at %s", dispatcher_index, target)
    return server


def compute_worker_fn(compute_config: TfDataServiceConfig):
    """What each rank of the compute job runs: its dispatcher (compute side, the first rank of each group),
    its worker, registered with the compute service, until someone asks the service to shut down."""
    import rvod.tensorflow as hvd

    hvd.init()
    index = hvd.rank()
    dispatcher_index = index // compute_config.workers_per_dispatcher
    compute = compute_config.compute_client(verbose=2)
    dispatcher_server = worker_server = None
    try:
        if compute_config.dispatcher_side == "compute" and index % compute_config.workers_per_dispatcher == 0:
            dispatcher_server = start_and_register_dispatcher(compute_config.dispatchers, dispatcher_index,
                                                              compute_config.dispatchers_work_dir,
                                                              compute_config.dispatchers_nic, compute)
        dispatcher_address = compute.wait_for_dispatcher_registration(dispatcher_index, compute_config.timeout)
        protocol, address = dispatcher_address.split("://", 1)
        worker_server = tf.data.experimental.service.WorkerServer(tf.data.experimental.service.WorkerConfig(
            protocol=protocol,
            dispatcher_address=address,
            worker_address=f"{_service_host(compute_config.dispatchers_nic)}:%port%",
            heartbeat_interval_ms=1000,
            dispatcher_timeout_ms=compute_config.timeout * 1000))
        compute.register_worker_for_dispatcher(dispatcher_index, index)
        _log.info("Worker %d for dispatcher %d registered", index, dispatcher_index)
        compute.wait_for_shutdown()
    finally:
        compute.close()
        if worker_server is not None:
            worker_server.stop()
        if dispatcher_server is not None:
            dispatcher_server.stop()
