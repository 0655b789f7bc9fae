"""`rvod.run(fn, ...)`: horovod.run's API: runs `fn(*args, **kwargs)` on every rank of a job and returns the
results in rank order.

The job is an rvodrun job (the same placement, ssh launch, checks and supervision) whose ranks run
`python -m rvod.runner.run_task`; with `use_mpi=True`, as with `rvodrun --mpi`, mpirun starts them. The
function travels cloudpickled through the job's authenticated rendezvous store, and each rank puts back its
result, or the traceback of what it raised. If any rank fails, `run` raises RuntimeError naming the rank,
with its traceback (or how its process ended).

With `min_num_proc`, `max_num_proc` or `host_discovery_script` the job is elastic: rvodrun's elastic driver
(rvod.runner.elastic) starts, restarts and adds the workers, each running `run_task`; the function, which
trains under `hvd.elastic.run`, comes back with the results of the ranks of the last world (each worker
puts its result under the rank it has when the function returns).
"""

from __future__ import annotations

import pickle
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from rvod.runner.job import JobSpec

FUNCTION_KEY = "rvod.run/function"
RESULT_KEY = "rvod.run/result/{rank}"
# How long the driver waits for the store to answer when it puts the function and reads the results.
_STORE_TIMEOUT_SECONDS = 30.0


def _deprecated_alias(old: str, new: str, old_value: Any, new_value: Any) -> Any:
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ValueError(f"give {new} or {old}, not both")
    warnings.warn(f"{old} is deprecated, use {new}", DeprecationWarning, stacklevel=3)
    return old_value


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: int | bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    network_interfaces: Sequence[str] | str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Runs `func(*args, **kwargs)` on `num_proc` ranks placed on `hosts` (or `hostfile`; default this
    machine) and returns the list of their return values, rank 0 first. Arguments mean what horovod.run's
    do. `min_num_proc`, `max_num_proc` or `host_discovery_script` make it an elastic job, as rvodrun's flags
    do (with `slots`, `reset_limit`, `cooldown_range`): `func` trains under `hvd.elastic.run`, and the results
    are those of the ranks of the world that finished. `use_mpi=True`
    starts the ranks with Open MPI's mpirun (ValueError where it is not installed), `mpi_args` being extra
    arguments for it."""
    import cloudpickle

    from rvod.runner import launch, mpi

    num_proc = _deprecated_alias("np", "num_proc", np, num_proc)
    min_num_proc = _deprecated_alias("min_np", "min_num_proc", min_np, min_num_proc)
    max_num_proc = _deprecated_alias("max_np", "max_num_proc", max_np, max_num_proc)
    if hosts is not None and hostfile is not None:
        raise ValueError("give hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("give use_gloo or use_mpi, not both")
    if mpi_args is not None and not use_mpi:
        raise ValueError("mpi_args is for mpirun, which rvod.run only uses with use_mpi=True")
    if use_mpi and shutil.which("mpirun") is None:
        raise ValueError(f"rvod.run: use_mpi=True {mpi.MISSING_MPIRUN}")
    if network_interface is not None:
        warnings.warn("network_interface is deprecated, use network_interfaces", DeprecationWarning, stacklevel=2)
    nics: list[str] = []
    for given in (network_interface, network_interfaces):
        if given:
            nics += [name.strip() for name in (given.split(",") if isinstance(given, str) else given)]
    if num_proc is not None and num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    # disable_cache and use_gloo ask for what rvod does anyway (as rvodrun's --disable-cache and --gloo).
    spec = JobSpec(
        num_proc=num_proc if num_proc is not None else 1,
        hosts=hosts,
        hostfile=hostfile,
        nics=tuple(nics),
        use_mpi=bool(use_mpi),
        mpi_args=mpi_args,
        start_timeout=start_timeout,
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        verbose=bool(verbose and verbose >= 2) if not isinstance(verbose, bool) else verbose,
        output_dir=output_filename,
        min_num_proc=min_num_proc,
        max_num_proc=max_num_proc,
        host_discovery_script=host_discovery_script,
        slots_per_host=slots,
        reset_limit=reset_limit,
        cooldown_range=tuple(cooldown_range) if cooldown_range else None,  # type: ignore[arg-type]
    )

    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    task = [executable or sys.executable, "-m", "rvod.runner.run_task"]
    if spec.elastic:
        if spec.use_mpi:
            raise ValueError("elastic training starts and restarts workers itself; it cannot run under use_mpi")
        return _run_elastic(launch.elastic_driver(spec, task), payload)
    plan = launch.plan_job(spec)
    job = launch.Job(spec, plan)
    if not spec.use_mpi:
        job.check_hosts()  # mpirun reaches the hosts itself
    with job:
        from rvod._rvod import StoreClient

        client = StoreClient(plan.rendezvous_addr, job.port, job.secret, _STORE_TIMEOUT_SECONDS)
        try:
            client.set(FUNCTION_KEY, payload)
            status = mpi.run_mpirun(job, task) if spec.use_mpi else job.run(task)
            outcomes = {}
            for slot in plan.slots:
                try:
                    outcomes[slot.rank] = pickle.loads(client.get(RESULT_KEY.format(rank=slot.rank), 0.0))
                except RuntimeError:
                    pass  # this rank put nothing back: it died, or was stopped
        finally:
            client.close()
    return _results(outcomes, len(plan.slots), status, job.failure)


def _run_elastic(driver, payload: bytes) -> list[Any]:
    """An elastic job (rvodrun's driver, with rvod.runner.run_task on every worker): the results are those of
    the ranks of the last world, which finished training; workers that died or left on the way put none."""
    outcomes: dict[int, tuple[bool, Any]] = {}

    def publish(client) -> None:
        client.set(FUNCTION_KEY, payload)

    def size() -> int:
        # The workers that finish are those of the newest world that started (a newer one never started
        # if training ended while it formed); a bigger, older world's ranks beyond it are not read.
        return len(driver.started_world.members) if driver.started_world is not None else 0

    def collect(client) -> None:
        for rank in range(size()):
            found = client.try_get(RESULT_KEY.format(rank=rank), 0.0)
            if found is not None:
                outcomes[rank] = pickle.loads(found)

    status = driver.run(publish, collect)
    return _results(outcomes, size() if status == 0 else len(outcomes), status, driver.failure)


def _results(outcomes: dict[int, tuple[bool, Any]], size: int, status: int, failure: str | None) -> list[Any]:
    """The ranks' results in rank order, or RuntimeError naming the rank that raised, or how the job failed."""
    for rank in sorted(outcomes):
        succeeded, value = outcomes[rank]
        if not succeeded:
            raise RuntimeError(f"rvod.run: rank {rank} raised an exception:\n{value}")
    if status != 0 or len(outcomes) != size:
        raise RuntimeError(f"rvod.run: the job failed ({failure or f'exit status {status}'})")
    return [outcomes[rank][1] for rank in range(size)]
