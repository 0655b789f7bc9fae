"""``ElasticRayExecutor``: horovod.ray's elastic API, run by rvodrun's elastic driver with Ray actors as workers.

The hosts are Ray's alive nodes (``RayHostDiscovery``: a node's CPUs, and GPUs with ``use_gpu``, make its
slots), read again every second. The driver (``rvod.runner.elastic``, the one rvodrun uses) forms the
worlds: each new worker is a Ray actor pinned to its node that runs the training function once, under
``hvd.elastic.run``. A node that dies takes its workers with it: the driver blacklists it and the job goes
on on the others, restored from the last commit; a node that joins gets workers (up to ``max_num_proc``)
that start from the committed state. ``run()`` returns the results of the ranks of the world that finished,
in rank order. The job's rendezvous store runs in the driver's process, on its node's address.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rvod.common import elastic_worker
from rvod.ray import ray_logger
from rvod.ray.runner import RaySettings
from rvod.runner import cluster_job
from rvod.runner import elastic as driver_module
from rvod.runner.elastic import ElasticDriver, ElasticSettings
from rvod.runner.hosts import Slot

WHERE = "rvod.ray"


class RayHostDiscovery:
    """The alive Ray nodes as hosts: ``find_available_hosts_and_slots()`` maps ``"<hostname>/<node id[:8]>"``
    to the workers its resources hold (CPUs // cpus_per_worker, and GPUs // gpus_per_worker with use_gpu).
    Several nodes on one machine are several hosts. Subclass it and set ``settings.discovery`` (with
    ``override_discovery=False``) to choose hosts yourself; a host may also be named by its node's IP address."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1, gpus_per_worker: float = 1,
                 cpus_per_slot: float | None = None, gpus_per_slot: float | None = None):
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_slot if cpus_per_slot is not None else cpus_per_worker
        self.gpus_per_worker = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts = {}
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            resources = node["Resources"]
            slots = resources.get("CPU", 0) // self.cpus_per_worker if self.cpus_per_worker else math.inf
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_worker)
            if slots and slots != math.inf:
                hosts[host_name(node)] = int(slots)
        return hosts


def host_name(node: dict[str, Any]) -> str:
    """The host name rvod gives a Ray node (an entry of ``ray.nodes()``)."""
    return f"{node['NodeManagerHostname']}/{node['NodeID'][:8]}"


def _scheduling(host: str) -> dict[str, Any]:
    """Ray actor options that put an actor on ``host``'s node (a name from ``host_name``, or a node's IP)."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    for node in alive:
        if host_name(node) == host:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}
    if any(node["NodeManagerAddress"] == host for node in alive):
        return {"resources": {f"node:{host}": 0.01}}
    raise ValueError(f"{WHERE}: host {host!r} is no alive Ray node (the discovery listed it; it is gone)")


@dataclass
class ElasticRaySettings(RaySettings):
    """What ``ElasticRayExecutor.create_settings`` returns. ``discovery``: an object with
    ``find_available_hosts_and_slots()`` (set by the executor unless ``override_discovery=False``)."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None
    elastic_timeout: float = 600
    discovery: Any = None

    @property
    def num_proc(self) -> int:
        return self.min_num_proc


def _one_of(default: Any, **given: Any) -> Any:
    """The one of ``given`` that is not None (ValueError when several are), else ``default``."""
    named = {name: value for name, value in given.items() if value is not None}
    if len(named) > 1:
        raise ValueError(f"give one of {', '.join(named)}, not several")
    return next(iter(named.values()), default)


@dataclass
class _Outcome:
    """How a worker's call ended: ``done`` (with its rank then and the value), ``left`` (no place in the new
    world), ``failed`` (the function raised: ``detail`` has the traceback) or ``died`` (its actor or node)."""

    kind: str
    rank: int = -1
    value: Any = None
    detail: str = ""


class _ElasticActor:
    """One elastic worker: a Ray actor that runs the training function once, in the worlds the driver forms."""

    def run(self, fn: Callable[[], Any], env: dict[str, str], queue: Any) -> _Outcome:
        cluster_job.apply_env(env)
        if "RVOD_NETWORK_INTERFACE" not in env:
            os.environ["RVOD_IFACE_ADDR"] = ray.util.get_node_ip_address()
        elastic_worker.leave_by_raising()
        ray_logger.configure(queue)
        try:
            value = fn()
        except elastic_worker.LeftTheJob:
            return _Outcome("left")
        except BaseException:  # noqa: BLE001 - whatever the function raised goes back to the driver
            return _Outcome("failed", int(os.environ["RVOD_RANK"]), detail=traceback.format_exc())
        return _Outcome("done", int(os.environ["RVOD_RANK"]), value)


class _ActorWorker:
    """The driver's handle on one worker actor (``rvod.runner.elastic.WorkerHandle``)."""

    def __init__(self, actor: Any, call: Any):
        self.actor = actor
        self._call = call
        self.outcome: _Outcome | None = None

    def _poll(self) -> _Outcome | None:
        if self.outcome is None and ray.wait([self._call], timeout=0)[0]:
            try:
                self.outcome = ray.get(self._call)
            except ray.exceptions.RayActorError as error:
                self.outcome = _Outcome("died", detail=str(error).strip().splitlines()[0][:300])
            except ray.exceptions.RayError as error:  # e.g. a result Ray could not hand back
                self.outcome = _Outcome("failed", detail=str(error))
            if self.outcome.kind != "done":
                _kill(self.actor)  # gives its resources back at once; a finished one goes with the job
        return self.outcome

    @property
    def returncode(self) -> int | None:
        outcome = self._poll()
        return None if outcome is None else 0 if outcome.kind in ("done", "left") else 1

    def finished(self) -> bool:
        return self._poll() is not None

    def describe_exit(self) -> str:
        outcome = self._poll()
        assert outcome is not None
        return {"done": "finished", "left": "returned without training further", "failed": f"raised:\n{outcome.detail}",
                "died": f"died with its Ray actor ({outcome.detail})"}[outcome.kind]


class _ActorLauncher:
    """Starts the elastic driver's workers as Ray actors (``rvod.runner.elastic.Launcher``)."""

    def __init__(self, fn: Callable[[], Any], queue: Any, options: dict[str, Any], env: dict[str, str],
                 verbose: bool):
        self._fn = fn
        self._verbose = verbose
        self._queue = queue
        self._options = options
        self._env = env
        self._class = ray.remote(_ElasticActor)

    def rendezvous_address(self, hosts: Sequence[str]) -> str:
        return ray.util.get_node_ip_address()

    def start(self, worker_id: int, slot: Slot, env: dict[str, str]) -> _ActorWorker:
        try:
            placement = _scheduling(slot.hostname)
        except ValueError as error:  # the node died since it was discovered: a worker that died at once
            worker = _ActorWorker(None, None)
            worker.outcome = _Outcome("died", detail=str(error))
            return worker
        actor = self._class.options(**self._options, **placement).remote()
        if self._verbose:
            print(f"{WHERE}: started worker {worker_id} as rank {slot.rank} on {slot.hostname}", file=sys.stderr,
                  flush=True)
        return _ActorWorker(actor, actor.run.remote(self._fn, {**self._env, **env}, self._queue))

    def kill(self, handle: _ActorWorker) -> None:
        if handle.actor is not None:
            _kill(handle.actor)

    def stop(self, handles: list[_ActorWorker]) -> None:
        for handle in handles:
            if handle.actor is not None:
                handle._poll()
                _kill(handle.actor)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - an actor already gone is what killing wants
        pass


class ElasticRayExecutor:
    """horovod.ray.ElasticRayExecutor: an elastic rvod job on the nodes of a Ray cluster.

        settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4)
        executor = ElasticRayExecutor(settings, cpus_per_worker=1)
        executor.start()
        results = executor.run(train_fn, callbacks=[print])   # train_fn uses hvd.elastic.run
        executor.shutdown()

    ``ray.init()`` must have been called. The executor assumes the whole cluster is its own: every node's
    resources count as slots. ``env_vars`` reach every worker. GPUs are given by Ray (it sets
    CUDA_VISIBLE_DEVICES of each actor).
    """

    @staticmethod
    def create_settings(min_num_proc: int | None = None, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: float | None = None,
                        timeout_s: float = 30, ssh_identity_file: str | None = None, nics: Any = None,
                        min_np: int | None = None, max_np: int | None = None, min_workers: int | None = None,
                        max_workers: int | None = None, cooldown_range: tuple[int, int] | None = None,
                        verbose: int | bool = 1, **extra: Any) -> ElasticRaySettings:
        """Settings for ``ElasticRayExecutor``: at least ``min_num_proc`` workers (``min_workers``; ``min_np``
        is deprecated), at most ``max_num_proc``; ``reset_limit``: how many times the world may change;
        ``cooldown_range``: (min, max) seconds a failed host stays blacklisted (for good without it);
        ``elastic_timeout``: how long the job waits for enough slots (default RVOD_ELASTIC_TIMEOUT, else 600);
        ``timeout_s``: how long ranks wait for each other in ``hvd.init()``; ``nics``: the network interfaces
        the ranks use; ``verbose`` >= 2 tells of every worker that starts and ends. ``ssh_identity_file``
        is accepted for Horovod's scripts and unused: Ray starts the workers."""
        low = _one_of(1, min_num_proc=min_num_proc, min_np=min_np, min_workers=min_workers)
        high = _one_of(None, max_num_proc=max_num_proc, max_np=max_np, max_workers=max_workers)
        if min_np is not None or max_np is not None:
            warnings.warn("min_np and max_np are deprecated, use min_num_proc and max_num_proc", DeprecationWarning,
                          stacklevel=2)
        if not isinstance(low, int) or low < 1 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ValueError(f"min_num_proc must be an integer >= 1 and max_num_proc one >= min_num_proc, got "
                             f"{low!r} and {high!r}")
        if cooldown_range is not None and not 0 <= cooldown_range[0] <= cooldown_range[1]:
            raise ValueError(f"cooldown_range (min, max) needs 0 <= min <= max, got {cooldown_range!r}")
        if isinstance(nics, str):
            nics = {name.strip() for name in nics.split(",") if name.strip()}
        return ElasticRaySettings(timeout_s=timeout_s, nics=set(nics) if nics else None,
                                  ssh_identity_file=ssh_identity_file, verbose=int(verbose), extra=extra,
                                  min_num_proc=low, max_num_proc=high, reset_limit=reset_limit,
                                  cooldown_range=tuple(cooldown_range) if cooldown_range else None,
                                  elastic_timeout=driver_module.elastic_timeout(elastic_timeout))

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False, cpus_per_slot: float | None = None,
                 gpus_per_slot: float | None = None, env_vars: dict[str, str] | None = None,
                 override_discovery: bool = True, cpus_per_worker: float | None = None,
                 gpus_per_worker: float | None = None):
        cpus = _one_of(1, cpus_per_worker=cpus_per_worker, cpus_per_slot=cpus_per_slot)
        gpus = _one_of(None, gpus_per_worker=gpus_per_worker, gpus_per_slot=gpus_per_slot)
        if gpus and not use_gpu:
            raise ValueError("gpus_per_worker is set but use_gpu is False; set use_gpu=True to reserve GPUs")
        gpus = (gpus or 1) if use_gpu else 0
        if cpus < 0 or (cpus == 0 and not use_gpu) or (use_gpu and gpus <= 0):
            raise ValueError(f"cpus_per_worker must be > 0 (>= 0 with use_gpu: slots are counted from them) and "
                             f"gpus_per_worker > 0, got {cpus} and {gpus}")
        if override_discovery or settings.discovery is None:
            settings.discovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_worker=cpus, gpus_per_worker=gpus or 1)
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus
        self.gpus_per_worker = gpus
        self.env_vars = {str(name): str(value) for name, value in (env_vars or {}).items()}
        self._started = False

    def start(self) -> None:
        """Checks that Ray runs and its hosts can be discovered; the workers start in ``run()``."""
        if not ray.is_initialized():
            raise RuntimeError(f"{WHERE}: Ray is not initialized; call ray.init() (or ray.init(address=...)) first")
        self.settings.discovery.find_available_hosts_and_slots()
        self._started = True

    def run(self, worker_fn: Callable[[], Any], callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Runs ``worker_fn()`` (which trains under ``hvd.elastic.run``) in an elastic job until it finishes;
        returns the values the ranks of the last world returned, in rank order. Each callback is called on
        the driver with every value a worker sends with ``ray_logger.log``. RuntimeError when the job fails
        (below ``min_num_proc`` for ``elastic_timeout``, past ``reset_limit``, every host blacklisted),
        with the traceback of a worker whose function raised."""
        if not self._started:
            raise RuntimeError(f"{WHERE}: the executor is not started; call start() first")
        delivery = ray_logger.Delivery(callbacks)
        options = {"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker}
        launcher = _ActorLauncher(worker_fn, delivery.queue, options, self.env_vars, self.settings.verbose >= 2)
        settings = self.settings
        driver = ElasticDriver(
            ElasticSettings(min_np=settings.min_num_proc, max_np=settings.max_num_proc, discovery_script=None,
                            fixed_hosts=None, slots_per_host=None, elastic_timeout=settings.elastic_timeout,
                            reset_limit=settings.reset_limit, cooldown_range=settings.cooldown_range),
            launcher, settings.discovery.find_available_hosts_and_slots, engine_settings=settings.engine_env(),
            verbose=settings.verbose >= 2, who=WHERE)
        try:
            status = driver.run()
        finally:
            delivery.close()
        delivery.raise_error()
        return _results(driver, status)

    def shutdown(self) -> None:
        """``run`` stops its workers and its queue itself; after this, ``start()`` is needed again."""
        self._started = False


def _results(driver: ElasticDriver, status: int) -> list[Any]:
    """The values the ranks of the last world returned, in rank order; RuntimeError saying why the job failed."""
    outcomes = [worker.process.outcome for worker in driver.workers]
    if status != 0:
        failed = [outcome for outcome in outcomes if outcome is not None and outcome.kind == "failed"]
        detail = f"\nrank {failed[0].rank} raised:\n{failed[0].detail}" if failed else ""
        raise RuntimeError(f"{WHERE}: the elastic job failed ({driver.failure or f'status {status}'}){detail}")
    world = driver.started_world.members if driver.started_world is not None else []
    done = sorted((outcome for outcome in (worker.process.outcome for worker in world)
                   if outcome is not None and outcome.kind == "done"), key=lambda outcome: outcome.rank)
    ranks = [outcome.rank for outcome in done]
    if ranks != list(range(len(world))):
        raise RuntimeError(f"{WHERE}: the elastic job ended without a result from every rank of its last world "
                           f"(got ranks {ranks} of {len(world)})")
    return [outcome.value for outcome in done]
