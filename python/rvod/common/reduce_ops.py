"""Reduce-op constants with Horovod's values, and the deprecated ``average=`` argument.

The values are Horovod's public API (``hvd.Sum == 1``), so they are written here; the engine's own codes
(``rvod._rvod.REDUCE_OPS``, from the Rust ``ReduceOp``) must be the same, which is checked at import: a
drift on either side stops ``import rvod.<framework>`` instead of reducing with the wrong op.
"""

import warnings

from rvod import _rvod
from rvod.exceptions import RvodInvalidArgumentError

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


def _check_engine_codes(engine_codes):
    """Raise ImportError unless the engine numbers its reduce ops as Horovod's public constants do."""
    ours = {name: code for code, name in _NAMES.items()}
    if dict(engine_codes) != ours:
        raise ImportError(
            f"rvod's native module numbers its reduce ops {dict(engine_codes)}, but Horovod's constants are {ours}: "
            "the extension and the Python package come from different builds"
        )


_check_engine_codes(_rvod.REDUCE_OPS)


def resolve_op(op, average, default=Average):
    """The reduce op to use given Horovod's ``op`` and deprecated ``average`` arguments."""
    if op is not None and average is not None:
        raise RvodInvalidArgumentError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in a future version",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    if op is None:
        return default
    if op not in _NAMES:
        raise RvodInvalidArgumentError(f"Unknown reduce op {op!r}; use one of Average, Sum, Adasum, Min, Max, Product")
    return op
