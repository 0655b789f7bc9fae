"""``rvod.spark.run``: horovod.spark.run's API, on Spark's barrier execution mode.

The job is one barrier stage of ``num_proc`` tasks (all start together, or none); task ``i`` is rank ``i``.
``BarrierTaskContext.getTaskInfos()`` says which executor host runs each rank: the ranks of a host are its
local ranks (they share memory), and rank 0's host serves the job's rendezvous store, whose port reaches
the other ranks through ``allGather``. The secret travels inside the task's closure (Spark's own channel).
Each rank runs in a process of its own (see ``rank_process``). A rank that fails reports its traceback
through an accumulator as its task ends; the driver then cancels the Spark job (every other task, and so
its rank process, is killed) and raises naming the rank. A task that dies without a report fails the job
the same way, as soon as Spark sees it fail. Before the barrier stage a probe checks that the executors'
Python can import rvod at all (``preflight``), so that mistake is named as what it is.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from pyspark import AccumulatorParam, BarrierTaskContext, SparkContext

from rvod.runner import cluster_job
from rvod.spark import preflight, rank_process

WHERE = "rvod.spark.run"
# How often the driver looks for failures while the job runs.
_POLL_SECONDS = 0.2
# How long the driver waits, after a rank failed, for the other failures it caused.
_FAILURE_GRACE_SECONDS = 2.0
# How long the driver lets Spark end a job whose task failed without a report, to hear its reason.
_SPARK_VERDICT_SECONDS = 5.0
# How long the driver waits for Spark to end a cancelled job.
_CANCEL_WAIT_SECONDS = 60.0


class _Reports(AccumulatorParam):
    """Reports of finished ranks, in the order they finished: ``(rank, succeeded, cluster_job.Failure or None)``."""

    def zero(self, value):
        return []

    def addInPlace(self, value1, value2):
        return list(value1) + list(value2)


def _rank_task(payload: bytes, secret: bytes, settings: dict[str, str], user_env: dict[str, str],
               reports: Any, capture: bool) -> Callable[[Any], Any]:
    def task(_partition):
        context = BarrierTaskContext.get()
        rank = context.partitionId()
        hosts = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
        address = cluster_job.store_address(hosts, hosts[0])
        hosted = cluster_job.HostedStore(address, secret) if rank == 0 else None
        try:
            port = int(context.allGather(str(hosted.port) if hosted else "")[0])
            slot = cluster_job.slots_for_hosts(hosts)[rank]
            env = {**os.environ, **user_env,
                   **cluster_job.rank_env(slot, address=address, port=port, secret=secret, settings=settings)}
            with rank_process.workdir(rank) as workdir:
                succeeded, value, out, err = rank_process.run_rank(rank, payload, env, workdir, capture)
            reports.add([(rank, succeeded, None if succeeded else value)])
            if succeeded:
                # Rank 0's store serves the others until every rank is done with it.
                context.barrier()
        finally:
            if hosted is not None:
                hosted.close()
        yield rank, succeeded, value, out, err

    return task


def _write_output(stream: IO[str] | None, rank: int, name: str, text: str, timestamp: bool) -> None:
    if stream is None or not text:
        return
    for line in text.splitlines():
        stamp = f"{datetime.datetime.now().isoformat(timespec='seconds')} " if timestamp else ""
        stream.write(f"{stamp}[{rank}]<{name}>:{line}\n")
    stream.flush()


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None, env: Mapping[str, str] | None = None,
        stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
        nics: Sequence[str] | None = None, prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks (default: ``sc.defaultParallelism``) as one
    rvod job and returns their results in rank order.

    ``start_timeout``: seconds the ranks wait for each other in ``hvd.init()``. ``env``: variables added to
    each rank's environment (the executor's own environment is the base). ``stdout``/``stderr``: streams of
    the driver that receive each rank's output, line by line prefixed with ``[rank]<stdout>:``, when the
    rank ends (without them, output goes to the executors' logs). ``nics``: network interfaces the ranks use.
    Raises RuntimeError naming the first rank that failed, with its traceback, or, before anything starts,
    saying that the executors' Python cannot import rvod.
    """
    import cloudpickle

    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError(f"{WHERE}: no active SparkContext; create a SparkSession (or SparkContext) first")
    num_proc = context.defaultParallelism if num_proc is None else num_proc
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"{WHERE}: num_proc must be a positive integer, got {num_proc!r}")
    settings: dict[str, str] = {}
    if start_timeout is not None:
        settings["RVOD_START_TIMEOUT"] = str(start_timeout)
    if nics:
        settings["RVOD_NETWORK_INTERFACE"] = ",".join(nics)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    preflight.check_workers_import_rvod(context, num_proc, WHERE)
    reports = context.accumulator([], _Reports())
    task = _rank_task(payload, cluster_job.new_secret(), settings, {str(k): str(v) for k, v in (env or {}).items()},
                      reports, capture=stdout is not None or stderr is not None)
    group = f"rvod.spark.run-{uuid.uuid4().hex}"
    outcome: dict[str, Any] = {}

    def collect() -> None:
        context.setJobGroup(group, f"rvod job of {num_proc} ranks", interruptOnCancel=True)
        try:
            rdd = context.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            outcome["rows"] = rdd.collect()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    started = time.monotonic()
    worker = threading.Thread(target=collect, name="rvod.spark.run", daemon=True)
    worker.start()
    lost = None
    while worker.is_alive():
        worker.join(_POLL_SECONDS)
        if _first_failure(reports.value) is not None:
            # The rank that began it may report just after the ranks it brought down.
            worker.join(_FAILURE_GRACE_SECONDS)
            break
        lost = _failed_task(context, group, reports.value, num_proc)
        if lost is not None:
            worker.join(_SPARK_VERDICT_SECONDS)  # Spark may be about to end the job with the task's error
            break
    if worker.is_alive():
        context.cancelJobGroup(group)
        worker.join(_CANCEL_WAIT_SECONDS)
    failure = _first_failure(reports.value)
    if failure is None and lost is not None:
        failure = lost + (f"; Spark says: {_spark_error(outcome['error'])}" if "error" in outcome else "")
    if verbose >= 2:
        print(f"{WHERE}: {num_proc} ranks ended after {time.monotonic() - started:.1f} s", file=sys.stderr)
    rows = sorted(outcome.get("rows") or [])
    for rank, _, _, out, err in rows:
        _write_output(stdout, rank, "stdout", out, prefix_output_with_timestamp)
        _write_output(stderr, rank, "stderr", err, prefix_output_with_timestamp)
    failure = failure or _first_failure([row[:3] for row in rows])
    if failure is not None:
        raise RuntimeError(f"{failure}\n{WHERE}: the Spark job was cancelled")
    if "error" in outcome:
        raise RuntimeError(
            f"{WHERE}: the Spark job of {num_proc} ranks failed: {_spark_error(outcome['error'])}") from None
    return [value for _, _, value, _, _ in rows]


def _spark_error(error: BaseException) -> str:
    """The Python traceback in a Spark job's error, else its first lines (Spark adds the JVM's stack)."""
    text = str(error)
    start = text.find("Traceback (most recent call last)")
    if start >= 0:
        end = text.find("\n\tat ", start)
        return text[start:end if end >= 0 else None].strip()
    return "\n".join(text.splitlines()[:5])


def _first_failure(reports: Sequence[tuple[int, bool, Any]]) -> str | None:
    failures = [failure for _, succeeded, failure in reports if not succeeded]
    return cluster_job.failure_message(WHERE, failures) if failures else None


def _failed_task(context: SparkContext, group: str, reports: Sequence[tuple[int, bool, Any]],
                 num_proc: int) -> str | None:
    """A task of the job that failed without a report (its process died, its executor was lost)."""
    tracker = context.statusTracker()
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info else ():
            stage_info = tracker.getStageInfo(stage)
            if stage_info is not None and stage_info.numFailedTasks > 0:
                finished = {rank for rank, _, _ in reports}
                missing = [rank for rank in range(num_proc) if rank not in finished]
                return (f"{WHERE}: a Spark task failed without reporting a result (its worker or executor died); "
                        f"ranks without a result: {missing}")
    return None
