"""Run rvod jobs on a Ray cluster with horovod.ray's API (``RayExecutor``).

Needs Ray (``pip install ray``); ``import rvod`` never imports it.
"""

from rvod.ray.runner import RayExecutor, RaySettings, WorkerFailed

__all__ = ["RayExecutor", "RaySettings", "WorkerFailed"]
