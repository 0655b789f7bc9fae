"""``RayExecutor``: horovod.ray's API over Ray actors.

``start()`` reserves a placement group (one bundle per worker packed onto as few nodes as Ray can, or one
bundle per host with ``num_hosts``), starts one actor per bundle and ranks them node by node, so that the
ranks of a node are consecutive and share memory. Rank 0's actor serves the job's rendezvous store; the
secret and the store's address reach the actors as arguments of Ray calls, never through a port of their own.
``run()`` calls a function on every rank and returns the results in rank order; when a rank raises or its
actor dies, every actor is stopped (no rank is left waiting in a collective) and ``run()`` raises naming the
rank; ``start()`` may then be called again.

With ``min_workers`` (Horovod's newer spelling of elastic Ray jobs) the executor is an ``ElasticRayExecutor``
underneath (rvod.ray.elastic): no placement group, workers follow the nodes. ``run(..., callbacks=...)``
passes what rank 0 logs with ``ray_logger`` to the callbacks on the driver, in both modes.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rvod.ray import ray_logger
from rvod.runner import cluster_job

WHERE = "rvod.ray"
# How long run() waits, after a rank failed, for the other failures it caused.
_FAILURE_GRACE_SECONDS = 1.0


@dataclass
class RaySettings:
    """What ``RayExecutor.create_settings`` returns (horovod.ray's MiniSettings, with the fields rvod uses)."""

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    verbose: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_env(self) -> dict[str, str]:
        env = {"RVOD_START_TIMEOUT": str(self.timeout_s)}
        if self.nics:
            env["RVOD_NETWORK_INTERFACE"] = ",".join(sorted(self.nics))
        return env


class WorkerFailed(RuntimeError):
    """A rank's function raised (the message names the rank and has its traceback)."""

    def __init__(self, failure: cluster_job.Failure):
        super().__init__(failure)  # the only argument, so that the exception unpickles on the driver
        self.failure = failure

    def __str__(self) -> str:
        return self.failure.detail


class _Worker:
    """One rank: a Ray actor that keeps the rank's environment, its executable and (rank 0) the store."""

    def __init__(self, env: dict[str, str]):
        cluster_job.apply_env(env)
        self.rank = -1
        self.executable = None
        self._store: cluster_job.HostedStore | None = None

    def place(self) -> tuple[str, str, str]:
        """(node id, node address, host name) of where Ray put this actor."""
        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), socket.gethostname()

    def serve_store(self, address: str, secret: bytes) -> int:
        self._store = cluster_job.HostedStore(address, secret)
        return self._store.port

    def join(self, rank: int, env: dict[str, str]) -> None:
        self.rank = rank
        cluster_job.apply_env(env)

    def start_executable(self, cls, args, kwargs) -> None:
        self.executable = cls(*args, **kwargs) if cls is not None else None

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return self._outcome(cluster_job.call(self.rank, fn, (self.executable,), {}))

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], queue: Any = None) -> Any:
        ray_logger.configure(queue)
        return self._outcome(cluster_job.call(self.rank, fn, args, kwargs))

    def _outcome(self, outcome: tuple[bool, Any]) -> Any:
        succeeded, value = outcome
        if not succeeded:
            raise WorkerFailed(value)
        return value


class RayExecutor:
    """horovod.ray.RayExecutor: rvod workers as Ray actors.

    Give ``num_workers`` (workers packed onto as few nodes as possible) or ``num_hosts`` and
    ``num_workers_per_host`` (one bundle per node, on distinct nodes); or ``min_workers`` (and
    ``max_workers``, ``reset_limit``, ``cooldown_range``, ``elastic_timeout``, ``override_discovery``) for an
    elastic job whose ``run`` trains under ``hvd.elastic.run``. ``ray.init()`` must have been called.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: set[str] | None = None, **extra: Any) -> RaySettings:
        """Settings for ``RayExecutor``: ``timeout_s`` bounds how long ranks wait for each other in
        ``hvd.init()``; ``placement_group_timeout_s`` how long ``start()`` waits for Ray's resources; ``nics``
        the network interfaces the ranks use. The ssh arguments are accepted for Horovod's scripts and unused:
        Ray starts the workers, not ssh."""
        return RaySettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                           nics=set(nics) if nics else None, ssh_identity_file=ssh_identity_file,
                           ssh_str=ssh_str, extra=extra)

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1, cpus_per_worker: int = 1,
                 use_gpu: bool = False, gpus_per_worker: int | None = None, min_workers: int | None = None,
                 max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: tuple[int, int] | None = None, elastic_timeout: float | None = None,
                 override_discovery: bool = True):
        self._elastic = None
        if min_workers is not None or max_workers is not None:
            if num_workers is not None or num_hosts is not None:
                raise ValueError("give num_workers (or num_hosts) for a fixed job, or min_workers for an elastic one, "
                                 "not both")
            if min_workers is None:
                raise ValueError("max_workers needs min_workers: an elastic job needs a positive min_workers")
            self._elastic = _elastic_executor(settings, min_workers, max_workers, reset_limit, cooldown_range,
                                              elastic_timeout, override_discovery, cpus_per_worker, use_gpu,
                                              gpus_per_worker)
            self.settings = self._elastic.settings
            self.workers = []
            return
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set but use_gpu is False; set use_gpu=True to reserve GPUs")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("give num_workers, or num_hosts and num_workers_per_host, not both")
        if num_workers is None and num_hosts is None:
            raise ValueError("give num_workers, or num_hosts and num_workers_per_host")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if cpus_per_worker < 0 or (gpus_per_worker is not None and gpus_per_worker < 1):
            raise ValueError(f"cpus_per_worker must be >= 0 and gpus_per_worker >= 1, got {cpus_per_worker}, "
                             f"{gpus_per_worker}")
        self.settings = settings or RaySettings()
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: list[Any] = []
        self._hosts: list[str] = []  # host name of each rank's node
        self._placement_group = None

    def _bundles(self) -> tuple[list[dict[str, float]], str, list[int]]:
        """The placement group's bundles, its strategy, and the bundle of each worker."""
        per_worker = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            per_worker["GPU"] = self.gpus_per_worker
        if self.num_hosts is None:
            return [dict(per_worker) for _ in range(self.num_workers)], "PACK", list(range(self.num_workers))
        per_host = {name: amount * self.num_workers_per_host for name, amount in per_worker.items()}
        bundle_of = [host for host in range(self.num_hosts) for _ in range(self.num_workers_per_host)]
        return [dict(per_host) for _ in range(self.num_hosts)], "STRICT_SPREAD", bundle_of

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: dict[str, str] | None = None) -> None:
        """Start the workers: place them, give each its rank, serve the store in rank 0, and create
        ``executable_cls(*executable_args, **executable_kwargs)`` in every worker (for ``execute``). An
        elastic executor starts its workers in ``run()``, and has no executable."""
        if self._elastic is not None:
            if executable_cls is not None:
                raise ValueError(f"{WHERE}: an elastic executor (min_workers) runs functions only; it has no "
                                 "executable_cls")
            self._elastic.env_vars.update({str(k): str(v) for k, v in (extra_env_vars or {}).items()})
            self._elastic.start()
            return
        if self.workers:
            raise RuntimeError(f"{WHERE}: the executor is already started; call shutdown() first")
        if not ray.is_initialized():
            raise RuntimeError(f"{WHERE}: Ray is not initialized; call ray.init() (or ray.init(address=...)) first")
        bundles, strategy, bundle_of = self._bundles()
        group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(group.ready(), timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            remove_placement_group(group)
            raise TimeoutError(
                f"{WHERE}: Ray could not reserve {len(bundles)} bundles of {bundles[0]} ({strategy}) within "
                f"{self.settings.placement_group_timeout_s} s; the cluster has {ray.available_resources()} "
                "available") from error
        self._placement_group = group
        base_env = {**self.settings.engine_env(), **{str(k): str(v) for k, v in (extra_env_vars or {}).items()}}
        actor = ray.remote(_Worker)
        try:
            created = [
                actor.options(
                    num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=bundle),
                ).remote(base_env)
                for bundle in bundle_of
            ]
            self.workers = created
            places = ray.get([worker.place.remote() for worker in created])
            # Ranks node by node, nodes in the order of their first worker.
            first_of_node: dict[str, int] = {}
            for index, (node, _, _) in enumerate(places):
                first_of_node.setdefault(node, index)
            order = sorted(range(len(created)), key=lambda i: (first_of_node[places[i][0]], i))
            self.workers = [created[i] for i in order]
            places = [places[i] for i in order]
            hosts = [f"{hostname}/{node[:8]}" for node, _, hostname in places]
            self._hosts = [f"{hostname} ({address})" for _, address, hostname in places]
            slots = cluster_job.slots_for_hosts(hosts)
            address = cluster_job.store_address(hosts, places[0][1])
            secret = cluster_job.new_secret()
            port = ray.get(self.workers[0].serve_store.remote(address, secret))
            several_hosts = len(set(hosts)) > 1
            joins = []
            for worker, slot, (_, node_address, _) in zip(self.workers, slots, places, strict=True):
                env = cluster_job.rank_env(slot, address=address, port=port, secret=secret, settings=base_env)
                if several_hosts and "RVOD_NETWORK_INTERFACE" not in env:
                    env["RVOD_IFACE_ADDR"] = node_address
                joins.append(worker.join.remote(slot.rank, env))
            ray.get(joins)
            ray.get([worker.start_executable.remote(executable_cls, list(executable_args or []),
                                                    dict(executable_kwargs or {}))
                     for worker in self.workers])
        except BaseException:
            self.shutdown()
            raise

    def _require_started(self) -> None:
        if self._elastic is not None:
            raise RuntimeError(f"{WHERE}: an elastic executor (min_workers) has only run(); its workers start and "
                               "stop with the job")
        if not self.workers:
            raise RuntimeError(f"{WHERE}: the executor is not started; call start() first")

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the list of ObjectRefs of the results, in rank order."""
        self._require_started()
        args, kwargs = list(args or []), dict(kwargs or {})
        return [worker.run.remote(fn, args, kwargs) for worker in self.workers]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: dict[str, Any] | None = None, callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order. If a rank raises or its actor
        dies, every worker is stopped and RuntimeError names the rank (with its traceback). Each callback
        is called on the driver with every value rank 0 logs with ``ray_logger.log``. Elastic: the results of
        the ranks of the world that finished (see ``ElasticRayExecutor.run``)."""
        if self._elastic is not None:
            return self._elastic.run(functools.partial(fn, *(args or []), **(kwargs or {})), callbacks)
        self._require_started()
        delivery = ray_logger.Delivery(callbacks)
        try:
            args, kwargs = list(args or []), dict(kwargs or {})
            results = self._gather([worker.run.remote(fn, args, kwargs, delivery.queue) for worker in self.workers])
        finally:
            delivery.close()
        delivery.raise_error()
        return results

    def execute(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` created); results in
        rank order."""
        self._require_started()
        return self._gather([worker.execute.remote(fn) for worker in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._require_started()
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def _gather(self, refs: list[Any]) -> list[Any]:
        """The values of ``refs`` (``refs[i]`` from rank i); at the first failure, stop every worker and raise."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        values: dict[int, Any] = {}
        failures: list[cluster_job.Failure] = []
        pending = list(refs)
        while pending:
            # After a failure, a moment for the ranks it brought down: the message shows the one that began it.
            timeout = _FAILURE_GRACE_SECONDS if failures else None
            try:
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            except BaseException:  # Ctrl-C, or Ray itself failing: no worker may go on alone
                self.shutdown()
                raise
            if not ready:
                break
            for ref in ready:
                rank = rank_of[ref]
                try:
                    values[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    failures.append(cluster_job.Failure(rank, f"its worker actor died ({error})"))
                except ray.exceptions.RayTaskError as error:
                    failures.append(error.cause.failure if isinstance(error.cause, WorkerFailed)
                                    else cluster_job.Failure(rank, str(error)))
                except BaseException as error:  # noqa: BLE001 - what Ray could not even hand back
                    failures.append(cluster_job.Failure(rank, f"{type(error).__name__}: {error}"))
        if failures:
            failures = [failure if failure.host else dataclasses.replace(failure, host=self._hosts[failure.rank])
                        for failure in failures]
            self.shutdown()
            raise RuntimeError(f"{cluster_job.failure_message(WHERE, failures)}\n"
                               f"{WHERE}: every worker was stopped; call start() to run again")
        return [values[rank] for rank in range(len(refs))]

    def shutdown(self) -> None:
        """Stop every worker and give back the placement group (``start()`` may be called again)."""
        if self._elastic is not None:
            self._elastic.shutdown()
            return
        workers, self.workers = self.workers, []
        for worker in workers:
            try:
                ray.kill(worker)
            except Exception:  # noqa: BLE001 - an actor that is already gone is what shutdown wants
                pass
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None


def _elastic_executor(settings, min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
                      override_discovery, cpus_per_worker, use_gpu, gpus_per_worker):
    """The ElasticRayExecutor behind ``RayExecutor(min_workers=...)``, with ``settings``'s values."""
    from rvod.ray.elastic import ElasticRayExecutor

    base = settings or RaySettings()
    elastic_settings = ElasticRayExecutor.create_settings(
        min_num_proc=min_workers, max_num_proc=max_workers, reset_limit=reset_limit, cooldown_range=cooldown_range,
        elastic_timeout=elastic_timeout, timeout_s=base.timeout_s, nics=base.nics, verbose=base.verbose)
    elastic_settings.discovery = getattr(settings, "discovery", None)
    return ElasticRayExecutor(elastic_settings, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker,
                              gpus_per_worker=gpus_per_worker, override_discovery=override_discovery)
