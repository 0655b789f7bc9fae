"""What every shim's distributed optimizer shares: checking its options and forming groups.

The checks here are the only copies: ``Reduction`` checks ``op``, ``gradient_predivide_factor``,
``num_groups`` and ``groups`` (given as the shim's own variables, described by a ``Variables``);
``refuse_rewrapping``, ``check_backward_passes_per_step`` and ``check_num_groups`` the rest. Averaging with
``gradient_predivide_factor`` f divides by f before the sum and multiplies by f/size after it (the engine's
Average divides by the size), so large gradients overflow less in low precision.
"""

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from rvod.common.process_sets import registered_id
from rvod.common.reduce_ops import _NAMES, Adasum, Average, Sum, resolve_op


def split_evenly(items, count):
    """``items`` in ``count`` consecutive chunks whose lengths differ by at most one (empty ones dropped)."""
    base, extra = divmod(len(items), count)
    chunks, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        if end > start:
            chunks.append(tuple(items[start:end]))
        start = end
    return chunks


def refuse_rewrapping(obj, wrapper_types, what="optimizer", wrapper="DistributedOptimizer"):
    """Refuse to wrap ``obj`` again when it already is one of the shim's ``wrapper_types``."""
    if isinstance(obj, wrapper_types):
        raise ValueError(f"this {what} is already a {wrapper}; wrap the plain {what} once")


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_backward_passes_per_step(passes):
    """``passes`` as an int, if it is one >= 1."""
    if not _is_int(passes) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
    return int(passes)


def check_num_groups(num_groups):
    """``num_groups`` as an int, if it is one >= 0 (0: no explicit groups)."""
    if not _is_int(num_groups) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative integer, got {num_groups!r}")
    return int(num_groups)


def check_predivide_factor(factor):
    """``gradient_predivide_factor`` as a float, if it is a finite number > 0."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"gradient_predivide_factor must be > 0 (and finite), got {factor!r}")
    return value


def _default_name(variable):
    return getattr(variable, "name", None) or f"<{type(variable).__name__} at {id(variable):#x}>"


@dataclass(frozen=True)
class Variables:
    """What a shim's variables are, for checking the lists of ``groups``: their type (and its name in
    messages), a hashable key identifying one, and the name that messages give one."""

    type_name: str = "variables"
    type: Any = object
    key: Callable[[Any], Any] = id
    name: Callable[[Any], str] = _default_name


class Reduction:
    """The checked reduction options of a distributed optimizer: ``op`` (Average or Sum, and Adasum
    where ``allow_adasum``), the scale factors to send with it, and ``groups``: None, an int > 0, or a
    list of lists of the keys (``variables.key``) of the variables reduced together."""

    def __init__(self, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, postscale_factor=1.0,
                 allow_adasum=False, variables=Variables()):
        op = resolve_op(op, None)
        if op == Adasum and not allow_adasum:
            raise ValueError("this gradient reducer does not take Adasum: Adasum combines parameter updates, so use "
                             "DistributedOptimizer(op=Adasum) of rvod.torch, rvod.tensorflow or rvod.keras, "
                             "DistributedGradientTape(op=Adasum), or hvd.allreduce with op=hvd.Adasum")
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"op must be Average or Sum (or Adasum), got {_NAMES[op]}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        factor = check_predivide_factor(gradient_predivide_factor)
        if num_groups != 0:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.",
                          DeprecationWarning, stacklevel=3)
            if groups is None:
                groups = check_num_groups(num_groups)
        self.op = op
        self.prescale_factor = 1.0 / factor
        self.postscale_factor = factor * postscale_factor
        self.groups = _checked_groups(groups, variables) or None

    def chunks(self, positions, keys):
        """``positions`` (of gradients to reduce) in the groups they are reduced in; ``keys[p]`` identifies
        the variable at position p, as the keys of ``groups``' lists do."""
        if isinstance(self.groups, int):
            return split_evenly(positions, self.groups)
        if self.groups is not None:
            group_of = {key: index for index, group in enumerate(self.groups) for key in group}
            chunks = {}
            for position in positions:
                chunks.setdefault(group_of.get(keys[position], ("alone", position)), []).append(position)
            return [tuple(chunk) for chunk in chunks.values()]
        return [tuple(positions)] if positions else []


def _checked_groups(groups, variables):
    """``groups`` (None, an int >= 0, or a list of lists of variables, none in two lists) with each
    variable replaced by its key."""
    if groups is None or (_is_int(groups) and groups >= 0):
        return None if groups is None else int(groups)
    valid_lists = isinstance(groups, (list, tuple)) and all(
        isinstance(group, (list, tuple)) and all(isinstance(v, variables.type) for v in group) for group in groups)
    if not valid_lists:
        raise ValueError(f"groups should be a non-negative integer or a list of list of {variables.type_name}, "
                         f"got {groups!r}")
    seen = set()
    keyed = []
    for group in groups:
        keys = []
        for variable in group:
            key = variables.key(variable)
            if key in seen:
                raise ValueError(f"parameter {variables.name(variable)} is in more than one group")
            seen.add(key)
            keys.append(key)
        keyed.append(keys)
    return keyed


class GradientReducer:
    """Callable: ``reducer(grads, variables) -> grads`` reduced across ``process_set``, for the
    DistributedGradientTape and distributed optimizers of the shims, which implement the hooks below.

    Dense gradients are compressed and reduced with one grouped allreduce per group (one group unless
    ``groups`` says otherwise), so the engine fuses them and, inside a ``tf.function``, they cost one graph
    node. Sparse gradients are reduced by the shim's sparse path unless ``sparse_as_dense``. ``None``
    gradients stay ``None``; gradients of registered local variables are not exchanged (divided by the set
    size when ``scale_local_gradients``). A rank outside the process set, or a set of one rank, reduces
    nothing.
    """

    def __init__(self, compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups, process_set,
                 scale_local_gradients=True, postscale_factor=1.0, allow_adasum=False):
        self.reduction = Reduction(op, gradient_predivide_factor, num_groups, groups, postscale_factor, allow_adasum,
                                   Variables(key=self.variable_key))
        registered_id(process_set)  # a rank outside the set reduces nothing, as in Horovod
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_variables = set()

    # Hooks.
    @staticmethod
    def variable_key(variable):
        """A hashable identity of a variable."""
        return id(variable)

    def is_sparse(self, grad):
        return False

    def densify(self, grad):
        return grad

    def divide(self, grad, count):
        return grad / count

    def reduce_sparse(self, grad, op, process_set):
        raise NotImplementedError

    def grouped_allreduce(self, grads, compression, op, prescale_factor, postscale_factor, process_set):
        raise NotImplementedError

    # The reduction.
    def register_local_variable(self, variable):
        """Leave this variable's gradient out of the exchange."""
        self.local_variables.add(self.variable_key(variable))

    def __call__(self, grads, variables=None):
        results = list(grads)
        keys = [None] * len(results) if variables is None else [self.variable_key(v) for v in variables]
        process_set, reduction = self.process_set, self.reduction
        if not process_set.included() or len(process_set.ranks) == 1:
            return results
        dense = []
        for i, grad in enumerate(results):
            if grad is None:
                continue
            if keys[i] in self.local_variables:
                if self.scale_local_gradients:
                    results[i] = self.divide(grad, len(process_set.ranks))
            elif self.is_sparse(grad) and not self.sparse_as_dense:
                results[i] = self.reduce_sparse(grad, reduction.op, process_set)
            else:
                results[i] = self.densify(grad)
                dense.append(i)
        for chunk in reduction.chunks(dense, keys):
            reduced = self.grouped_allreduce([results[i] for i in chunk], self.compression, reduction.op,
                                             reduction.prescale_factor, reduction.postscale_factor, process_set)
            for i, value in zip(chunk, reduced):
                results[i] = value
        return results
