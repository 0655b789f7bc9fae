"""Deterministic names for unnamed collectives, so ranks that make the same successful calls match them.

Tensor ops are named ``<op>.noname.<n>``, counted per process set in the order ops are *accepted*: an op
refused at submission gives its number back (``give_back``), and the next unnamed op of that set takes it,
so a refused call moves no name. The object helpers (``broadcast_object``, ``allgather_object``) count
apart (``next_object_name``), so no tensor op, refused or failed, moves their names. ``join()`` restarts the
global set's counts once every rank has joined: ranks that ran different numbers of ops before joining (or
whose ops failed because others had joined) name the same again afterwards. Everything restarts at shutdown.
"""

import collections
import heapq
import itertools
import threading

# Counter key -> itertools.count (atomic under the GIL: the path of every unnamed op takes one number).
_counters = collections.defaultdict(lambda: itertools.count(1))
# Counter key -> numbers refused ops gave back, smallest first; taken before the counter's next number.
_returned = {}
_returned_lock = threading.Lock()


def _object_key(process_set_id):
    return ("object", process_set_id)


def _take(key):
    if _returned:
        with _returned_lock:
            numbers = _returned.get(key)
            if numbers:
                number = heapq.heappop(numbers)
                if not numbers:
                    del _returned[key]
                return number
    return next(_counters[key])


def next_name(prefix, process_set_id=0):
    return f"{prefix}.noname.{_take(process_set_id)}"


def next_suffix(process_set_id=0):
    """``next_name`` without its prefix, ``noname.<n>``, for callers that prefix names elsewhere (the path of
    every small unnamed op: one call when no number was given back)."""
    if _returned:
        return f"noname.{_take(process_set_id)}"
    return f"noname.{next(_counters[process_set_id])}"


def next_object_name(prefix, process_set_id=0):
    """The name of an unnamed object helper call, ``<prefix>.noname.<n>``, counted apart from tensor ops."""
    return f"{prefix}.noname.{_take(_object_key(process_set_id))}"


def give_back(names, process_set_id=0, objects=False):
    """Return the numbers of ``names`` (from this module, for calls refused before anything was sent) so
    the next unnamed calls of the set take them again."""
    key = _object_key(process_set_id) if objects else process_set_id
    with _returned_lock:
        numbers = _returned.setdefault(key, [])
        for name in names:
            heapq.heappush(numbers, int(name.rsplit(".", 1)[1]))


def restart_global():
    """Restart the global set's counts (every rank at the same point: after ``join()``)."""
    with _returned_lock:
        for key in (0, _object_key(0)):
            _counters.pop(key, None)
            _returned.pop(key, None)


def reset():
    with _returned_lock:
        _counters.clear()
        _returned.clear()
