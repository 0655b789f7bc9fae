"""Deterministic names for unnamed collectives: ``<op>.noname.<n>``, counted per process set, so ranks
that issue unnamed ops on a set in the same order match them, whatever they do on other sets. The
counters restart at shutdown."""

import collections
import itertools

_counters = collections.defaultdict(lambda: itertools.count(1))


def next_name(prefix, process_set_id=0):
    return f"{prefix}.{next_suffix(process_set_id)}"


def next_suffix(process_set_id=0):
    """``next_name`` without its prefix, ``noname.<n>``, for callers that prefix names elsewhere."""
    return f"noname.{next(_counters[process_set_id])}"


def reset():
    _counters.clear()
