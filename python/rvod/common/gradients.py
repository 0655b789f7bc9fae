"""What every shim's distributed optimizer shares: checking the reduction options and forming groups.

Averaging with ``gradient_predivide_factor`` f divides by f before the sum and multiplies by f/size after
it (the engine's Average divides by the size), so large gradients overflow less in low precision.
"""

import warnings

from rvod.common.reduce_ops import Adasum, Average, Sum, resolve_op


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


class Reduction:
    """The checked reduction options of a distributed optimizer: ``op`` (Average or Sum, and Adasum
    where ``allow_adasum``: gradient tapes), the scale factors to send with it, and ``groups`` (None, an
    int, or a list of lists)."""

    def __init__(self, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, postscale_factor=1.0,
                 allow_adasum=False):
        op = resolve_op(op, None)
        if op == Adasum and not allow_adasum:
            raise ValueError("this gradient reducer does not take Adasum: Adasum combines parameter updates, so use "
                             "DistributedOptimizer(op=Adasum) of rvod.torch, rvod.tensorflow or rvod.keras, "
                             "DistributedGradientTape(op=Adasum), or hvd.allreduce with op=hvd.Adasum")
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"op must be Average or Sum, got {op}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if num_groups != 0:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.",
                          DeprecationWarning, stacklevel=3)
            if groups is None:
                groups = num_groups
        valid_int = isinstance(groups, int) and not isinstance(groups, bool) and groups >= 0
        valid_lists = isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in groups)
        if groups is not None and not valid_int and not valid_lists:
            raise ValueError(f"groups must be an int >= 0 or a list of lists of variables, got {groups!r}")
        self.op = op
        self.prescale_factor = 1.0 / gradient_predivide_factor
        self.postscale_factor = gradient_predivide_factor * postscale_factor
        self.groups = groups or None

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
        from rvod.common.process_sets import registered_id

        if isinstance(groups, (list, tuple)):
            groups = [[self.variable_key(v) for v in group] if isinstance(group, (list, tuple)) else group
                      for group in groups]
        self.reduction = Reduction(op, gradient_predivide_factor, num_groups, groups, postscale_factor, allow_adasum)
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
