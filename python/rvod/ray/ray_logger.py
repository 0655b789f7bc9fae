"""Values sent from the training function to callbacks on the driver (horovod.ray's ``ray_logger``).

``ElasticRayExecutor.run(fn, callbacks=[...])`` gives every worker a Ray queue (``configure``); ``log(info)``
puts ``info`` on it from rank 0 (from every rank with ``chief_only=False``), and the driver calls each
callback with it, in the order it was logged. Called where no queue was configured, ``log`` warns once and
drops the value.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

_queue: Any = None
_warned = False


def configure(queue: Any) -> None:
    """Sets the queue ``log`` puts values on (done by the executor in each worker)."""
    global _queue
    _queue = queue


def log(info_dict: Any, chief_only: bool = True) -> None:
    """Sends ``info_dict`` (anything Ray can pickle) to the driver's callbacks: from rank 0 only, unless
    ``chief_only`` is False. The rank is the worker's rank in its current world."""
    global _warned
    if chief_only and os.environ.get("RVOD_RANK") != "0":
        return
    if _queue is not None:
        _queue.put(info_dict)
    elif not _warned:
        _warned = True
        warnings.warn("rvod.ray.ray_logger.log called in a worker with no queue: only ElasticRayExecutor.run "
                      "configures one; the value is dropped", stacklevel=2)
