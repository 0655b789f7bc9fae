"""Checks, before the barrier stage starts, that Spark's Python workers can import rvod.

The rank tasks' closures name rvod's modules, so an executor whose Python lacks rvod (``PYSPARK_PYTHON``
unset, so the executors run another interpreter) would fail every rank while unpickling its task, and the
reason would arrive as a lost task with Spark's ``ModuleNotFoundError`` deep in its text. The probe here runs
one ordinary (non-barrier) task per rank first. Its function is compiled from source outside any module, so
cloudpickle sends it by value and the executors can run it without rvod; it reports the worker's host,
interpreter and whether ``import rvod`` works there.
"""

from __future__ import annotations

import os
from typing import Any

# Compiled into a namespace that is not a module, so the function travels by value (cloudpickle pickles
# functions of importable modules by reference, which an executor without rvod could not resolve).
_PROBE_SOURCE = '''
def probe(_partition):
    import socket
    import sys
    try:
        import rvod._rvod  # noqa: F401  (the native engine too: a wheel for another platform fails here)
        problem = None
    except BaseException as error:  # noqa: BLE001 - reported to the driver
        problem = f"{type(error).__name__}: {error}"
    yield socket.gethostname(), sys.executable, sys.version.split()[0], problem
'''


def _probe_function():
    namespace: dict[str, Any] = {"__name__": "rvod_spark_preflight_probe"}
    exec(compile(_PROBE_SOURCE, "<rvod.spark preflight probe>", "exec"), namespace)  # noqa: S102
    return namespace["probe"]


def _workers_python(context: Any) -> str:
    configured = getattr(context, "pythonExec", None) or os.environ.get("PYSPARK_PYTHON")
    unset = "" if os.environ.get("PYSPARK_PYTHON") else "; PYSPARK_PYTHON is not set on the driver"
    return f"{configured!r}{unset}" if configured else f"Spark's default{unset}"


def check_workers_import_rvod(context: Any, num_proc: int, where: str) -> None:
    """Raises RuntimeError saying which executor Python cannot import rvod, and what to do, if any cannot."""
    remedy = ("install rvod in the executors' Python, or set PYSPARK_PYTHON (before the SparkContext is "
              "created) to a Python where rvod is installed, such as the driver's")
    try:
        reports = context.parallelize(range(num_proc), num_proc).mapPartitions(_probe_function()).collect()
    except Exception as error:  # noqa: BLE001 - Spark's reason is kept in the message
        lines = [line for line in str(error).splitlines() if line.strip() and not line.startswith("\tat ")]
        reason = "\n".join(lines[-5:])
        raise RuntimeError(
            f"{where}: Spark's Python workers could not run a probe task before the job started (workers' "
            f"Python: {_workers_python(context)}); {remedy}. Spark says:\n{reason}") from None
    broken = sorted({(host, python, version, problem) for host, python, version, problem in reports if problem})
    if broken:
        where_it_failed = "; ".join(f"on {host}, {python} (Python {version}): {problem}"
                                    for host, python, version, problem in broken)
        raise RuntimeError(f"{where}: rvod is not importable in the Spark executors' Python ({where_it_failed}); "
                           f"{remedy}. (Workers' Python as configured: {_workers_python(context)}.)")
