"""Reduce-op constants with Horovod's values, and the deprecated ``average=`` argument."""

import warnings

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


def resolve_op(op, average, default=Average):
    """The reduce op to use given Horovod's ``op`` and deprecated ``average`` arguments."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
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
        raise ValueError(f"Unknown reduce op {op!r}; use one of Average, Sum, Adasum, Min, Max, Product")
    return op
