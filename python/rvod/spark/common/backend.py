"""How an estimator runs its training function on ``num_proc`` ranks: horovod.spark.common.backend's API.

``SparkBackend`` runs it with ``rvod.spark.run`` (one barrier stage of the active Spark session); another
backend (a cluster of your own) implements ``Backend.run`` and ``num_processes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any


class Backend:
    """Runs a function on every rank of a job and returns the ranks' results in rank order."""

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> list[Any]:
        raise NotImplementedError

    def num_processes(self) -> int:
        raise NotImplementedError


class SparkBackend(Backend):
    """Ranks as the tasks of one Spark barrier stage (``rvod.spark.run``); the arguments are ``run``'s.

    ``num_proc`` defaults to the Spark context's ``defaultParallelism``; ``env`` is added to every rank's
    environment (``run``'s ``env`` adds to it); ``stdout``/``stderr`` receive the ranks' output.
    """

    def __init__(self, num_proc: int | None = None, env: Mapping[str, str] | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
                 nics: Sequence[str] | None = None, start_timeout: float | None = None,
                 prefix_output_with_timestamp: bool = False, **unused: Any):
        if unused:
            raise TypeError(f"rvod.spark.common.backend: SparkBackend does not take {sorted(unused)}")
        self._num_proc = num_proc
        self._env = dict(env or {})
        self._stdout = stdout
        self._stderr = stderr
        self._verbose = verbose
        self._nics = nics
        self._start_timeout = start_timeout
        self._prefix_output_with_timestamp = prefix_output_with_timestamp

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> list[Any]:
        from rvod.spark.runner import run

        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(), start_timeout=self._start_timeout,
                   env={**self._env, **(env or {})}, stdout=self._stdout, stderr=self._stderr,
                   verbose=self._verbose, nics=self._nics,
                   prefix_output_with_timestamp=self._prefix_output_with_timestamp)

    def num_processes(self) -> int:
        if self._num_proc is None:
            from pyspark import SparkContext

            context = SparkContext._active_spark_context
            if context is None:
                raise RuntimeError("rvod.spark.common.backend: no active SparkContext; create a SparkSession first")
            self._num_proc = context.defaultParallelism
        return self._num_proc
