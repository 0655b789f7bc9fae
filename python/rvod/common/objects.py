"""Broadcasting and gathering arbitrary picklable objects, written once over a shim's byte-tensor ops.

Unnamed calls are matched across ranks by call order (per process set). Horovod names them by the
object's type instead, which differs between ``obj`` on the root and ``None`` elsewhere and then never
matches."""

import io

import cloudpickle
import numpy as np

from rvod.common import naming


def _to_bytes(obj):
    buffer = io.BytesIO()
    cloudpickle.dump(obj, buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def broadcast_object(broadcast, rank, obj, root_rank=0, name=None, process_set_id=0):
    """``broadcast(array, root_rank, name)`` broadcasts a NumPy array; returns root's object everywhere."""
    name = naming.next_name("broadcast_object", process_set_id) if name is None else name
    if rank == root_rank:
        payload = _to_bytes(obj)
        broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{name}.sz")
        broadcast(payload, root_rank, f"{name}.t")
        return obj
    length = int(broadcast(np.zeros(1, dtype=np.int64), root_rank, f"{name}.sz")[0])
    payload = broadcast(np.zeros(length, dtype=np.uint8), root_rank, f"{name}.t")
    return cloudpickle.loads(np.asarray(payload).tobytes())


def allgather_object(allgather, obj, name=None, process_set_id=0):
    """``allgather(array, name)`` allgathers NumPy arrays; returns every rank's object, in rank order."""
    name = naming.next_name("allgather_object", process_set_id) if name is None else name
    payload = _to_bytes(obj)
    sizes = np.asarray(allgather(np.array([payload.size], dtype=np.int64), f"{name}.sz"))
    data = np.asarray(allgather(payload, f"{name}.t")).tobytes()
    objects, offset = [], 0
    for size in sizes.tolist():
        objects.append(cloudpickle.loads(data[offset:offset + size]))
        offset += size
    return objects
