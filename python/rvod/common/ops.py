"""The collective ops, written once for every framework.

A shim passes a *tensor adapter* (see ``TensorAdapter``) that turns its tensors into DLPack capsules and
capsules back into tensors; everything else (naming, argument checks, handles, keeping inputs alive until
the engine is done with them, in-place write-back) happens here. An unnamed op refused with a ``TypeError``
or ``ValueError`` (``RvodInvalidArgumentError``: at submission, so nothing was sent; or, for an op run at once,
by the engine alike on every rank) gives its name back (see ``naming``); a mismatch or a failed op keeps it.
"""

import math
from threading import get_ident

from rvod import _rvod
from rvod.common import naming
from rvod.common.process_sets import global_process_set, process_set_id_of
from rvod.common.reduce_ops import Adasum, Average, Sum, resolve_op
from rvod.exceptions import RvodInvalidArgumentError, RvodMismatchError

# Collective kinds, as the engine numbers them (its own table, not a copy: a kind it renames fails here).
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN = (
    _rvod.COLLECTIVE_KINDS[kind]
    for kind in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join")
)
_KIND_NAMES = {code: kind for kind, code in _rvod.COLLECTIVE_KINDS.items()}
# The engine's element types by name (NumPy's names; bfloat16 is ml_dtypes'), for shims that check dtypes by name.
DTYPE_NAMES = frozenset(_rvod.DTYPES)


class TensorAdapter:
    """How a framework's tensors cross to the engine. Shims subclass this."""

    def export(self, tensor):
        """Return ``(capsule, holder)``: a DLPack capsule of a C-contiguous CPU tensor with the values of
        ``tensor`` and the object owning that memory (``tensor`` itself when no copy was needed)."""
        raise NotImplementedError

    def export_for_write(self, tensor):
        """Like ``export``, for a tensor an in-place op writes its result into. Frameworks that run ops
        asynchronously wait here for every pending read of ``tensor`` as well as every pending write."""
        return self.export(tensor)

    def export_unchecked(self, tensors, for_write):
        """What the engine takes for ``tensors`` without ``export``'s per-tensor checks (DLPack capsules, or
        exact ``numpy.ndarray``s as they are), or ``None`` where the framework has no such shortcut (or a
        tensor plainly needs the careful path). The engine refuses what it cannot take as it is (other
        devices, dtypes, non-contiguous or read-only memory, other objects), and the op is then exported again
        tensor by tensor with ``export``, which copies or explains. Only for tensors whose memory the engine
        sees exactly (no lazy negation or conjugation bits)."""
        return None

    def export_one(self, tensor):
        """``export_unchecked([tensor], ...)``'s one capsule (or ``None``), without the lists: the path of an
        asynchronous op on one tensor, which a burst takes a thousand times. The engine refuses what it
        cannot take as it is, and the op then goes through ``export``."""
        return None

    # Whether the framework's tensors go to the engine as they are (NumPy's: the engine takes exact ndarrays
    # and refuses anything else without sending anything); otherwise ``as_ndarray`` converts them.
    tensors_are_ndarrays = False

    def as_ndarray(self, tensor):
        """An exact ``numpy.ndarray`` sharing ``tensor``'s memory and holding its values, found cheaply, or
        ``None`` (then the op takes the ``export`` path). The engine takes the array as it is or refuses it
        (a dtype it cannot reduce, non-contiguous or read-only memory) without sending anything; a refused
        one is exported with ``export``, which copies or explains."""
        return None

    def from_ndarray(self, array):
        """A framework tensor viewing ``array``, a result the engine made (no copy)."""
        raise NotImplementedError

    def from_dlpack(self, capsule):
        """A framework tensor viewing the engine-owned memory of ``capsule`` (no copy)."""
        raise NotImplementedError

    def copy_(self, dst, src):
        """Copy the values of ``src`` into ``dst`` (used to write back in-place results)."""
        raise NotImplementedError

    def to_int_list(self, values):
        """A Python list of ints from a list or a 1-D integer tensor (alltoall splits)."""
        return [int(v) for v in values]

    def received_splits(self, splits):
        """What alltoall returns as the received splits, given them as a list of ints."""
        return splits

    def stream_of(self, tensor):
        """For a tensor on a GPU, the framework's current stream on its device (a ``cudaStream_t`` as an int):
        the engine records the tensor's ready event there. ``None`` for host tensors, or for objects whose
        ``__dlpack__(stream=...)`` the adapter called with rvod's stream (``_rvod.device_stream``)."""
        return None

    def consumer_stream(self):
        """The stream that uses an op's GPU results next (torch: the current CUDA stream), which the engine
        makes wait for them without blocking; ``None``: the host waits for them. Asked by ``synchronize``; an
        op waited for at once (``wait_for``, a synchronous op) takes the stream ``stream_of`` gave at its
        submission instead, which no user code can have changed meanwhile."""
        return None


# Bound once: the one native entry of every op (``_rvod.submit``), and the wait.
_submit_native = _rvod.submit
_wait = _rvod.wait

# An op in flight: handle -> (finish, adapter, context, *keepalive). ``finish(adapter, context, outputs,
# received_splits, last_joined)`` builds its result; the rest (inputs, capsules, copies) must stay alive
# until the engine is done with it. One tuple per op and module-level finishers (no closures): a burst of a thousand
# pending ops then creates few objects for the garbage collector to trace again and again.
_pending = {}

# The thread inside ``wait_for``, whose next op may run on that thread (see ``wait_for``); None when none.
# A plain global compared with the thread's id rather than a thread-local (each attribute access of a
# threading.local costs ~0.5k instructions, and a small op made seven). Two threads in ``wait_for`` at
# once: one finds the other's id here, and its op takes the asynchronous path (same result, a little later).
_waiter = None


class _Ran:
    """What ``_submit`` returns under ``wait_for``: the op ran to completion; ``result`` is its result."""

    __slots__ = ("result",)

    def __init__(self, result):
        self.result = result


def _original(adapter, context, outputs, received_splits, last_joined):
    return context  # an in-place op: its input


def _originals(adapter, context, outputs, received_splits, last_joined):
    return list(context)


def _new_tensor(adapter, context, outputs, received_splits, last_joined):
    return adapter.from_dlpack(outputs[0])


def _new_tensors(adapter, context, outputs, received_splits, last_joined):
    return [adapter.from_dlpack(c) for c in outputs]


def _alltoall_result(adapter, with_splits, outputs, received_splits, last_joined):
    output = adapter.from_dlpack(outputs[0])
    return (output, adapter.received_splits(received_splits)) if with_splits else output


def _nothing(adapter, context, outputs, received_splits, last_joined):
    return None


def _last_joined(adapter, context, outputs, received_splits, last_joined):
    return last_joined


def _copied_back(adapter, context, outputs, received_splits, last_joined):
    """An in-place op whose inputs were exported as copies: write the results back, then finish."""
    finish, inner_context, tensors, holders = context
    for original, holder in zip(tensors, holders):
        if holder is not original:
            adapter.copy_(original, holder)
    return finish(adapter, inner_context, outputs, received_splits, last_joined)


def _prefixed(prefix, name, process_set):
    """The op's name; an unnamed op takes the next number of its process set, once the set is accepted."""
    if name is not None:
        return f"{prefix}.{name}"
    return naming.next_name(prefix, process_set_id_of(process_set))


def _group_names(prefix, name, count, process_set):
    if name is not None:
        return [f"{prefix}.{name}_{i}" for i in range(count)]
    set_id = process_set_id_of(process_set)
    return [naming.next_name(prefix, set_id) for _ in range(count)]


def _give_back(error, names, process_set):
    """The unnamed op behind ``names`` raised ``error`` (a ``TypeError`` or ``ValueError``): unless ranks
    disagreed about it (``RvodMismatchError``, raised on every rank, which keeps the names), it was refused,
    and its numbers go back to the set's counter."""
    if not isinstance(error, RvodMismatchError):
        naming.give_back(names, process_set_id_of(process_set))


def wait_for(start, *args, **kwargs):
    """``synchronize(start(*args, **kwargs))`` for an ``*_async`` function ``start`` that returns the handle
    of the one op it submits, telling the engine that the caller waits at once: an idle engine then runs
    the op on this thread (GIL released) instead of handing it to its own thread and back, which is most
    of the time of a small op; the result is built as soon as the op is done (see ``_track``)."""
    global _waiter
    me = get_ident()
    _waiter = me
    try:
        handle = start(*args, **kwargs)
    except BaseException:
        if _waiter == me:
            _waiter = None
        raise
    if type(handle) is _Ran:
        return handle.result
    if _waiter == me:
        _waiter = None
    return synchronize(handle)


def _consumer_stream(adapter):
    """The stream an op's GPU results are used on next (``None``: the host waits; ops without tensors)."""
    return None if adapter is None else adapter.consumer_stream()


def _track(handle, wait, pending, stream):
    """Remember a submitted op until ``synchronize``; under ``wait_for`` (``wait``), wait for it here instead,
    its GPU results made ready on ``stream``, the one it was submitted with (the current stream of its tensors'
    GPU, which nothing can have changed since; ``None``: host tensors, or the host waits)."""
    global _waiter
    if not wait:
        _pending[handle] = pending
        return handle
    _waiter = None  # one op per wait_for
    try:
        outputs, received_splits, last_joined = _rvod.wait(handle, stream)
    except KeyboardInterrupt:
        _pending[handle] = pending  # still running and may write into its tensors: keep them alive
        raise
    finish, adapter, context = pending[:3]
    return _Ran(finish(adapter, context, outputs, received_splits, last_joined))


class _Op:
    """What the engine is told of an op besides its names and tensors, as ``_submit`` and the paths after a
    refusal take it (one record, not a dozen positional arguments). The hot paths (``_run_now``, ``_ran``,
    ``_submit_one``) call the engine with plain arguments instead and build one only when they fall back."""

    __slots__ = ("kind", "in_place", "op", "prescale", "postscale", "root", "splits", "set_id", "packed",
                 "compression")

    def __init__(self, kind, in_place=False, op=Sum, prescale=1.0, postscale=1.0, root=-1, splits=(),
                 process_set=global_process_set, packed=False, compression=0):
        self.kind, self.in_place, self.op, self.prescale, self.postscale = kind, in_place, op, prescale, postscale
        self.root, self.splits, self.packed, self.compression = int(root), splits, packed, compression
        # Every rank belongs to the global set; the engine itself refuses ops before init().
        self.set_id = 0 if process_set is global_process_set else process_set_id_of(process_set)

    def submit(self, names, tensors, wait, stream=None):
        """``_rvod.submit`` of lists of ``names`` and ``tensors`` (capsules or arrays); ``stream``: the
        framework's current stream for tensors on a GPU (see ``TensorAdapter.stream_of``)."""
        return _submit_native(self.kind, names, tensors, self.in_place, self.op, self.prescale, self.postscale,
                              self.root, self.set_id, wait, self.packed, self.splits, stream, self.compression)

    def full_name(self, name):
        return f"{_KIND_NAMES[self.kind]}.{name}"


def _run_now(kind, name, adapter, tensor, in_place, op, prescale, postscale, root, process_set):
    """Run one op on ``tensor`` and return its result (``tensor`` itself when ``in_place``); ``name`` is the
    user's, or ``noname.<n>``, which the engine prefixes with the kind. The path of every small synchronous
    op, written for few Python calls: an exact ndarray from the adapter goes to ``_rvod.submit`` with
    ``wait``, which runs a small op in steady state as one exchange with the peers, on this thread, and
    returns its result;
    otherwise the op is submitted and waited for, as ``wait_for`` does. (``allreduce`` and ``broadcast`` call
    ``_rvod.submit`` themselves for NumPy on the global set, and ``_ran`` with what it returned.)"""
    array = tensor if adapter.tensors_are_ndarrays else adapter.as_ndarray(tensor)
    if array is None:
        record = _Op(kind, in_place, op, prescale, postscale, root, process_set=process_set)
        return _submit(record, [record.full_name(name)], adapter, [tensor], _original if in_place else _new_tensor,
                       tensor, wait=True).result
    # Every rank belongs to the global set; the engine itself refuses ops before init().
    set_id = 0 if process_set is global_process_set else process_set_id_of(process_set)
    result = _submit_native(kind, name, array, in_place, op, prescale, postscale, root, set_id, True)
    return _ran(result, kind, name, adapter, tensor, array, in_place, op, prescale, postscale, root, process_set)


def _ran(result, kind, name, adapter, tensor, array, in_place, op, prescale, postscale, root, process_set):
    """The op's result from what ``_rvod.submit`` returned for ``array`` (``tensor`` as an ndarray)."""
    if result is None:
        return tensor  # done in place
    if type(result) is int:  # submitted: wait for it, keeping the memory alive until it completes
        _pending[result] = (_original if in_place else _new_tensor, adapter, tensor, tensor, array)
        return synchronize(result)
    if result is not NotImplemented:
        return adapter.from_ndarray(result)
    # Refused as it is (nothing was sent): exported, it crosses again once.
    record = _Op(kind, in_place, op, prescale, postscale, root, process_set=process_set)
    return _submit_exported(record, [record.full_name(name)], adapter, [tensor],
                            _original if in_place else _new_tensor, tensor, True).result


def _submit(record, names, adapter, tensors, finish, context, wait=None):
    """Submit the op ``record`` describes on ``tensors`` (named ``names``); returns its handle, or under
    ``wait_for`` (or ``wait``) a ``_Ran`` with its result."""
    if wait is None:
        wait = _waiter is not None and _waiter == get_ident()
    capsules = adapter.export_unchecked(tensors, record.in_place)
    if capsules is not None:
        stream = adapter.stream_of(tensors[0]) if tensors else None
        try:
            handle = record.submit(names, capsules, wait, stream)
        except (TypeError, ValueError):
            pass  # exported again below, tensor by tensor: that path copies what it can and explains the rest
        else:
            if not wait:  # the common case, inline: a burst submits a thousand of these
                _pending[handle] = (finish, adapter, context, tensors, capsules)
                return handle
            return _track(handle, wait, (finish, adapter, context, tensors, capsules), stream)
    return _submit_exported(record, names, adapter, tensors, finish, context, wait)


def _submit_exported(record, names, adapter, tensors, finish, context, wait):
    """``_submit`` through the adapter's ``export``, which copies what the engine cannot take as it is and
    explains the rest: for tensors the engine refused as they are (each crosses the boundary once that way)."""
    in_place = record.in_place
    capsules, holders = [], []
    export = adapter.export_for_write if in_place else adapter.export
    for tensor in tensors:
        capsule, holder = export(tensor)
        capsules.append(capsule)
        holders.append(holder)
    if in_place and any(holder is not original for original, holder in zip(tensors, holders)):
        finish, context = _copied_back, (finish, context, tensors, holders)
    stream = adapter.stream_of(tensors[0]) if tensors else None
    handle = record.submit(names, capsules, wait, stream)
    return _track(handle, wait, (finish, adapter, context, tensors, capsules, holders), stream)


def _submit_one(kind, name, adapter, tensor, in_place, finish, op=Sum, prescale=1.0, postscale=1.0, root=-1,
                process_set=global_process_set):
    """Submit an asynchronous op on one tensor, named ``<kind>.<name>`` (``name``: the user's, or
    ``noname.<n>``); returns its handle. The path of every ``*_async`` call on one tensor, written for a burst:
    one native call and one tuple per op (``_submit``'s lists, per-op records and argument tuples cost a
    thousand-op burst of torch tensors ~20% of its time, a tenth of it in the garbage collector). Whatever
    the engine cannot take as it is (and ops under ``wait_for``) goes through ``_submit``."""
    if _waiter is None:
        exported = tensor if adapter.tensors_are_ndarrays else adapter.export_one(tensor)
        if exported is not None:
            # Every rank belongs to the global set; the engine itself refuses ops before init().
            set_id = 0 if process_set is global_process_set else process_set_id_of(process_set)
            handle = _submit_native(kind, name, exported, in_place, op, prescale, postscale, root, set_id, False,
                                    False, None, adapter.stream_of(tensor))
            if handle is not NotImplemented:
                _pending[handle] = (finish, adapter, tensor, exported)
                return handle
            # Refused as it is (nothing was sent): exported, it crosses again once.
            record = _Op(kind, in_place, op, prescale, postscale, root, process_set=process_set)
            return _submit_exported(record, [record.full_name(name)], adapter, [tensor], finish, tensor, False)
    record = _Op(kind, in_place, op, prescale, postscale, root, process_set=process_set)
    return _submit(record, [record.full_name(name)], adapter, [tensor], finish, tensor)


def _submit_into(name, adapter, tensor, output, op, prescale, postscale, process_set):
    """An asynchronous reducescatter of ``tensor`` whose result the engine writes into ``output`` (the handle's
    result is ``output``). The output's memory must be what the engine writes: a copy would not be seen."""
    shape = tuple(int(d) for d in tensor.shape)
    size, rank = process_set.size(), process_set.rank()
    rows = (shape[0] // size + (rank < shape[0] % size)) if shape else 0
    block = (rows,) + shape[1:]
    if math.prod(block) != math.prod(int(d) for d in output.shape):
        raise RvodInvalidArgumentError(f"reducescatter '{name}': the output tensor has shape {tuple(output.shape)}, and "
                                       f"this rank's block of a tensor of shape {shape} is {block}")
    capsule, holder = adapter.export(tensor)
    out_capsule, out_holder = adapter.export_for_write(output)
    if out_holder is not output:
        raise RvodInvalidArgumentError(f"reducescatter '{name}': the output tensor must be contiguous host memory "
                                       "the result can be written into as it is")
    set_id = 0 if process_set is global_process_set else process_set_id_of(process_set)
    handle = _submit_native(REDUCESCATTER, name, capsule, False, op, prescale, postscale, -1, set_id, False, False,
                            None, adapter.stream_of(tensor), output=out_capsule)
    _pending[handle] = (_original, adapter, output, holder, capsule, out_capsule)
    return handle


def poll(handle):
    """True when the op behind ``handle`` has completed (never blocks)."""
    if handle not in _pending:
        raise ValueError(f"unknown handle {handle}")
    return _rvod.poll(handle)


def synchronize(handle):
    """Wait for ``handle`` (releasing the GIL) and return its result; ``None`` for an unknown handle."""
    pending = _pending.get(handle)
    if pending is None:
        return None
    try:
        outputs, received_splits, last_joined = _wait(handle, _consumer_stream(pending[1]))
    except KeyboardInterrupt:
        # The op is still running and may write into its tensors: keep them alive.
        raise
    except BaseException:
        del _pending[handle]
        raise
    del _pending[handle]
    return pending[0](pending[1], pending[2], outputs, received_splits, last_joined)


def allreduce_async(adapter, tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, in_place=False, compression=0):
    """Start an allreduce of ``tensor``; ``compression``: the engine's code (see ``rvod.common.compression``)."""
    op = resolve_op(op, average)
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        if compression:
            record = _Op(ALLREDUCE, in_place, op, prescale_factor, postscale_factor, process_set=process_set,
                         compression=compression)
            return _submit(record, [record.full_name(name)], adapter, [tensor],
                           _original if in_place else _new_tensor, tensor)
        return _submit_one(ALLREDUCE, name, adapter, tensor, in_place, _original if in_place else _new_tensor, op,
                           prescale_factor, postscale_factor, -1, process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def allreduce(adapter, tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, in_place=False, compression=0):
    """``synchronize(allreduce_async(...))``: the result, ``tensor`` itself when ``in_place``."""
    if compression:
        return wait_for(allreduce_async, adapter, tensor, average, name, op, prescale_factor, postscale_factor,
                        process_set, in_place, compression)
    op = resolve_op(op, average)
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        if adapter.tensors_are_ndarrays and process_set is global_process_set:
            # A small allreduce in a loop costs a few hundred nanoseconds: every Python call shows (see _run_now).
            result = _submit_native(ALLREDUCE, name, tensor, in_place, op, prescale_factor, postscale_factor, -1, 0, True)
            if result is None:
                return tensor
            if type(result) is not int and result is not NotImplemented:
                return result  # the new array: an ndarray adapter's tensor as it is
            return _ran(result, ALLREDUCE, name, adapter, tensor, tensor, in_place, op, prescale_factor,
                        postscale_factor, -1, process_set)
        return _run_now(ALLREDUCE, name, adapter, tensor, in_place, op, prescale_factor, postscale_factor, -1,
                        process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def grouped_allreduce_async(adapter, tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, in_place=False, compression=0):
    op = resolve_op(op, average)
    tensors = list(tensors)
    if not tensors:
        raise RvodInvalidArgumentError("grouped_allreduce needs at least one tensor")
    # One name for the whole group: the engine packs it into one tensor per dtype (members that differ
    # across ranks are reported as '<name>_<index>'). Adasum needs every tensor's bounds on every rank, so
    # its groups go tensor by tensor, one name each, and are fused (each tensor keeps its coefficients);
    # so do compressed groups (each tensor keeps its error feedback and PowerSGD factors by name).
    packed = op != Adasum and not compression
    if packed:
        names = [_prefixed("grouped_allreduce", name, process_set)]
    else:
        names = _group_names("grouped_allreduce", name, len(tensors), process_set)
    finish = _originals if in_place else _new_tensors
    try:
        record = _Op(ALLREDUCE, in_place, op, prescale_factor, postscale_factor, process_set=process_set,
                     packed=packed, compression=compression)
        return _submit(record, names, adapter, tensors, finish, tensors)
    except (TypeError, ValueError) as error:
        if name is None:
            _give_back(error, names, process_set)
        raise


def allgather_async(adapter, tensor, name=None, process_set=global_process_set):
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        return _submit_one(ALLGATHER, name, adapter, tensor, False, _new_tensor, process_set=process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def allgather(adapter, tensor, name=None, process_set=global_process_set):
    """``synchronize(allgather_async(...))``: every rank's rows, concatenated in rank order. A small one in
    steady state runs as one exchange of round headers on this thread (see ``_run_now``)."""
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        return _run_now(ALLGATHER, name, adapter, tensor, False, Sum, 1.0, 1.0, -1, process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def grouped_allgather_async(adapter, tensors, name=None, process_set=global_process_set):
    tensors = list(tensors)
    if not tensors:
        raise RvodInvalidArgumentError("grouped_allgather needs at least one tensor")
    names = _group_names("grouped_allgather", name, len(tensors), process_set)
    try:
        return _submit(_Op(ALLGATHER, process_set=process_set), names, adapter, tensors, _new_tensors, None)
    except (TypeError, ValueError) as error:
        if name is None:
            _give_back(error, names, process_set)
        raise


def broadcast_async(adapter, tensor, root_rank, name=None, process_set=global_process_set, in_place=False):
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        return _submit_one(BROADCAST, name, adapter, tensor, in_place, _original if in_place else _new_tensor,
                           root=int(root_rank), process_set=process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def broadcast(adapter, tensor, root_rank, name=None, process_set=global_process_set, in_place=False):
    """``synchronize(broadcast_async(...))``: the result, ``tensor`` itself when ``in_place``."""
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        if adapter.tensors_are_ndarrays and process_set is global_process_set:  # as allreduce's
            result = _submit_native(BROADCAST, name, tensor, in_place, Sum, 1.0, 1.0, root_rank, 0, True)
            if result is None:
                return tensor
            return _ran(result, BROADCAST, name, adapter, tensor, tensor, in_place, Sum, 1.0, 1.0, root_rank,
                        process_set)
        return _run_now(BROADCAST, name, adapter, tensor, in_place, Sum, 1.0, 1.0, root_rank, process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def alltoall_async(adapter, tensor, splits=None, name=None, process_set=global_process_set, with_splits=None):
    """The result is ``(output, received_splits)`` when ``splits`` is given (or ``with_splits`` is true),
    else the output alone."""
    split_list = [] if splits is None else adapter.to_int_list(splits)
    with_splits = splits is not None if with_splits is None else with_splits
    names = [_prefixed("alltoall", name, process_set)]
    try:
        record = _Op(ALLTOALL, splits=split_list, process_set=process_set)
        return _submit(record, names, adapter, [tensor], _alltoall_result, with_splits)
    except (TypeError, ValueError) as error:
        if name is None:
            _give_back(error, names, process_set)
        raise


def reducescatter_async(adapter, tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, output=None):
    """Start a reducescatter; ``output`` (a contiguous host tensor of the input's dtype holding exactly this
    rank's block) receives the result instead of a new tensor, and ``synchronize`` returns it."""
    op = resolve_op(op, None)
    unnamed = name is None
    if unnamed:
        name = naming.next_suffix(process_set_id_of(process_set))
    try:
        if output is not None:
            return _submit_into(name, adapter, tensor, output, op, prescale_factor, postscale_factor, process_set)
        return _submit_one(REDUCESCATTER, name, adapter, tensor, False, _new_tensor, op, prescale_factor,
                           postscale_factor, process_set=process_set)
    except (TypeError, ValueError) as error:
        if unnamed:
            _give_back(error, [name], process_set)
        raise


def grouped_reducescatter_async(adapter, tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    op = resolve_op(op, None)
    tensors = list(tensors)
    if not tensors:
        raise RvodInvalidArgumentError("grouped_reducescatter needs at least one tensor")
    names = _group_names("grouped_reducescatter", name, len(tensors), process_set)
    try:
        record = _Op(REDUCESCATTER, False, op, prescale_factor, postscale_factor, process_set=process_set)
        return _submit(record, names, adapter, tensors, _new_tensors, None)
    except (TypeError, ValueError) as error:
        if name is None:
            _give_back(error, names, process_set)
        raise


def barrier(process_set=global_process_set):
    """Block until every rank of the set reaches the barrier."""
    set_id = 0 if process_set is global_process_set else process_set_id_of(process_set)
    handle = _submit_native(BARRIER, "", None, False, Sum, 1.0, 1.0, -1, set_id, True)
    if handle is not None:  # submitted, not run at once: wait for it
        _pending[handle] = (_nothing, None, None)
        synchronize(handle)


def join():
    """Signal that this rank has no more data; blocks until every rank has joined. Meanwhile allreduces
    submitted by other ranks complete with this rank contributing zeros. Returns the last rank to join.
    Every rank leaves it at the same point, whatever it ran before, so the global set's unnamed ops are
    counted afresh from there (see ``naming``)."""
    handle = _submit_native(JOIN, [], [], False, Sum, 1.0, 1.0, -1, 0, True)
    _pending[handle] = (_last_joined, None, None)
    last_joined = synchronize(handle)
    naming.restart_global()
    return last_joined
