"""Broadcasting and gathering arbitrary picklable objects, written once over a shim's byte-tensor ops."""

import io

import cloudpickle
import numpy as np


def _to_bytes(obj):
    buffer = io.BytesIO()
    cloudpickle.dump(obj, buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def broadcast_object(broadcast, rank, obj, root_rank=0, name=None):
    """``broadcast(array, root_rank, name)`` broadcasts a NumPy array; returns root's object everywhere."""
    name = name or type(obj).__name__
    if rank == root_rank:
        payload = _to_bytes(obj)
        broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{name}.sz")
        broadcast(payload, root_rank, f"{name}.t")
        return obj
    length = int(broadcast(np.zeros(1, dtype=np.int64), root_rank, f"{name}.sz")[0])
    payload = broadcast(np.zeros(length, dtype=np.uint8), root_rank, f"{name}.t")
    return cloudpickle.loads(np.asarray(payload).tobytes())


def allgather_object(allgather, obj, name=None):
    """``allgather(array, name)`` allgathers NumPy arrays; returns every rank's object, in rank order."""
    name = name or type(obj).__name__
    payload = _to_bytes(obj)
    sizes = np.asarray(allgather(np.array([payload.size], dtype=np.int64), f"{name}.sz"))
    data = np.asarray(allgather(payload, f"{name}.t")).tobytes()
    objects, offset = [], 0
    for size in sizes.tolist():
        objects.append(cloudpickle.loads(data[offset:offset + size]))
        offset += size
    return objects
