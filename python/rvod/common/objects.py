"""Broadcasting and gathering arbitrary picklable objects: the one implementation every shim exposes.

An object travels as its cloudpickle bytes in a NumPy ``uint8`` array, after its length in an ``int64``
array, so an object of any size arrives whole. The arrays go to the engine as NumPy arrays whatever the
framework, so ``rvod.torch``, ``rvod.tensorflow`` (eager or graph mode), ``rvod.mxnet`` and ``rvod.numpy``
behave the same: a shim only chooses which arguments of Horovod's signature it shows.

Unnamed calls are matched across ranks by call order (per process set), counted apart from tensor ops (see
``naming``): an unnamed tensor op refused, or failed on some ranks only, does not move them. A call refused
before anything was sent (an object that cannot be pickled, a root or set this rank cannot use) uses no
name. Horovod names them by the object's type instead, which differs between ``obj`` on the root and
``None`` elsewhere and then never matches.
"""

import contextlib
import io

import cloudpickle
import numpy as np

from rvod.common import basics, naming, ops
from rvod.common.numpy_adapter import NumpyAdapter
from rvod.common.process_sets import global_process_set, process_set_id_of
from rvod.exceptions import RvodMismatchError

_adapter = NumpyAdapter()


def _to_bytes(obj):
    buffer = io.BytesIO()
    cloudpickle.dump(obj, buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def _broadcast(array, root_rank, name, process_set):
    return ops.wait_for(ops.broadcast_async, _adapter, array, root_rank, name, process_set)


def _allgather(array, name, process_set):
    return ops.wait_for(ops.allgather_async, _adapter, array, name, process_set)


@contextlib.contextmanager
def _refusal_gives_back(name, unnamed, process_set):
    """Around an object helper's first op: refused at submission (nothing sent), an unnamed call gives its
    name back."""
    try:
        yield
    except (TypeError, ValueError) as error:
        if unnamed and not isinstance(error, RvodMismatchError):
            naming.give_back([name], process_set_id_of(process_set), objects=True)
        raise


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s object (any picklable object, of any size) on every rank of ``process_set``;
    ``obj`` is ignored on the other ranks."""
    root = basics.rank() == root_rank
    payload = _to_bytes(obj) if root else None
    unnamed = name is None
    if unnamed:
        name = naming.next_object_name("broadcast_object", process_set_id_of(process_set))
    with _refusal_gives_back(name, unnamed, process_set):
        length = np.array([payload.size if root else 0], dtype=np.int64)
        length = int(_broadcast(length, root_rank, f"{name}.sz", process_set)[0])
    if root:
        _broadcast(payload, root_rank, f"{name}.t", process_set)
        return obj
    payload = _broadcast(np.zeros(length, dtype=np.uint8), root_rank, f"{name}.t", process_set)
    return cloudpickle.loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """A list with the object of every rank of ``process_set`` (picklable, of any size), in rank order."""
    payload = _to_bytes(obj)
    unnamed = name is None
    if unnamed:
        name = naming.next_object_name("allgather_object", process_set_id_of(process_set))
    with _refusal_gives_back(name, unnamed, process_set):
        sizes = _allgather(np.array([payload.size], dtype=np.int64), f"{name}.sz", process_set)
    data = _allgather(payload, f"{name}.t", process_set).tobytes()
    objects, offset = [], 0
    for length in sizes.tolist():
        objects.append(cloudpickle.loads(data[offset:offset + length]))
        offset += length
    return objects
