"""Run rvod jobs on a Ray cluster with horovod.ray's API.

Submodules: ``runner`` (``RayExecutor``: a fixed number of workers), ``elastic`` (``ElasticRayExecutor``:
workers follow the cluster's nodes as they come and go), ``ray_logger`` (values from the workers to the
driver's callbacks), ``train`` (a Ray Train backend). Needs Ray (``pip install ray``); ``import rvod`` never
imports it.
"""

from rvod.ray.elastic import ElasticRayExecutor, RayHostDiscovery
from rvod.ray.runner import RayExecutor, RaySettings, WorkerFailed

__all__ = ["ElasticRayExecutor", "RayExecutor", "RayHostDiscovery", "RaySettings", "WorkerFailed"]
