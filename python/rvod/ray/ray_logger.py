"""Values sent from the training function to callbacks on the driver (horovod.ray's ``ray_logger``).

``ElasticRayExecutor.run(fn, callbacks=[...])`` and ``RayExecutor.run(..., callbacks=[...])`` open a
``Delivery`` on the driver: a Ray queue on the driver's node, and a thread that calls each callback with
every value that arrives, in the order logged. Each worker is given the queue (``configure``); ``log(info)``
puts ``info`` on it from rank 0 (from every rank with ``chief_only=False``). With no callbacks there is no
queue and ``log`` drops the value; called where no executor configured the worker, it warns once.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

_queue: Any = None
_configured = False
_warned = False


def configure(queue: Any) -> None:
    """Sets the queue ``log`` puts values on (None: the driver has no callbacks); done by the executors."""
    global _queue, _configured
    _queue = queue
    _configured = True


def log(info_dict: Any, chief_only: bool = True) -> None:
    """Sends ``info_dict`` (anything Ray can pickle) to the driver's callbacks: from rank 0 only, unless
    ``chief_only`` is False. The rank is the worker's rank in its current world."""
    global _warned
    if chief_only and os.environ.get("RVOD_RANK") != "0":
        return
    if _queue is not None:
        _queue.put(info_dict)
    elif not _configured and not _warned:
        _warned = True
        warnings.warn("rvod.ray.ray_logger.log called in a process no rvod.ray executor runs: the value is dropped",
                      stacklevel=2)


class Delivery:
    """On the driver: calls ``callbacks`` with what workers log, from a thread, until ``close()``. ``queue``
    is what the workers are to ``configure`` (None without callbacks). The first exception a callback
    raised is kept in ``error``."""

    def __init__(self, callbacks: Sequence[Callable[[Any], Any]] | None):
        from ray.util.queue import Queue

        self._callbacks = list(callbacks or [])
        self.queue: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._deliver, name="rvod.ray callbacks", daemon=True)
        if self._callbacks:
            here = ray.get_runtime_context().get_node_id()
            self.queue = Queue(actor_options={
                "num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)})
            self._thread.start()

    def _deliver(self) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except Empty:
                if self._done.is_set():
                    return
                continue
            except Exception as error:  # noqa: BLE001 - the queue's actor is gone: nothing more will come
                print(f"rvod.ray: callbacks stopped: {error}", file=sys.stderr, flush=True)
                return
            for callback in self._callbacks:
                try:
                    callback(item)
                except BaseException as error:  # noqa: BLE001 - the executor raises it once the job ended
                    self.error = self.error or error

    def close(self) -> None:
        """Delivers what is still queued (bounded: 30 s), then removes the queue."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.queue is not None:
            try:
                ray.kill(self.queue.actor)
            except Exception:  # noqa: BLE001 - a queue already gone is what closing wants
                pass
            self.queue = None

    def raise_error(self) -> None:
        """RuntimeError from the first exception a callback raised, if one did."""
        if self.error is not None:
            raise RuntimeError("rvod.ray: a callback raised") from self.error
