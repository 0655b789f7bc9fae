"""Deterministic names for unnamed collectives: ``<op>.noname.<n>`` with one counter per process, so
ranks that issue unnamed ops in the same order match them. The counter restarts at shutdown."""

import itertools

_counter = itertools.count(1)


def next_name(prefix):
    return f"{prefix}.noname.{next(_counter)}"


def reset():
    global _counter
    _counter = itertools.count(1)
