"""``DistributedOptimizer(..., sharded=True)``: optimizer state sharded across ranks (ZeRO-1/2).

The layout is ``rvod.common.sharding``'s: each rank owns a balanced chunk of every trained parameter, and
the wrapped optimizer's parameter groups hold, instead of the model's parameters, one flat *shard*
parameter per (group, dtype) made of this rank's chunks, so its state (Adam's moments) is this rank's
share only. The gradient hooks of ``DistributedOptimizer`` start a reducescatter of each gradient instead of
an allreduce (same names, ops, scale factors, compression, groups, ``backward_passes_per_step``), and the
model's gradient is dropped once it is sent (ZeRO-2: ``p.grad`` is None after ``synchronize()``; the
reduced gradient of the owned chunk is the shard's ``.grad``). ``step()`` reads the shards from the
parameters (so ``broadcast_parameters`` or loading a model state dict is seen), steps the wrapped optimizer
on them, and starts allgathering the updated chunks into the parameters; it returns without waiting, and
the allgather is finished before the parameters are next read (``rvod.torch.parameter_gathers``: a module's
forward or state dict; code that reads ``p`` itself calls ``optimizer.wait_for_parameters()`` first). A CPU
parameter then takes the allgather's result as its memory (``p.data`` is swapped, not copied into), so a tensor
that views a parameter's memory taken before a step (``p.detach()``, ``p.data``) does not follow it after.

Checkpoints: ``state_dict()`` is this rank's shard state plus the layout (under ``SHARDED_KEY``);
``consolidate_state_dict(to=0)`` returns on rank ``to`` the state dict a plain optimizer of the wrapped
class would have (``to=None``: on every rank); ``load_state_dict`` takes a consolidated dict, this rank's
sharded dict, or the list of every rank's sharded dicts of a job of any size (resharded here).
``broadcast_optimizer_state`` sends the group options and a consolidated dict loaded on the root only.

The wrapped optimizer must update each element from that element's gradient and state alone (SGD, Adam,
AdamW, RMSprop, Adagrad, ...); LBFGS, SparseAdam and Adafactor are refused, as is ``op=Adasum``.
Gradient clipping: ``optimizer.clip_grad_norm_(max_norm)`` (the model's ``p.grad`` are gone) clips the
shards' gradients by the norm of the whole model's gradient.
"""

import collections
import math

import torch

from rvod.common.compression import NoneCompressor
from rvod.common.sharding import (SHARDED_KEY, Param, ShardLayout, StateOps, check_own_shard, join_shards,
                                  split_params)
from rvod.torch import parameter_gathers
from rvod.torch.functions import allgather_object, broadcast_object
from rvod.common.reduce_ops import Max, Sum
from rvod.torch.mpi_ops import (allreduce, grouped_allgather_async, grouped_reducescatter_async, rank,
                                reducescatter_async, synchronize)

_ELEMENTWISE_ONLY = ("the wrapped optimizer must update each element from its own gradient and state, as "
                     "SGD, Adam and AdamW do")
_REFUSED = {"LBFGS": "LBFGS evaluates the whole model in its step",
            "SparseAdam": "SparseAdam takes sparse gradients, and sharded gradients are dense",
            "Adafactor": "Adafactor factors its state by the rows and columns of whole parameters"}

_OPS = StateOps(
    is_per_element=lambda value, numel: torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel,
    flat_slice=lambda value, start, stop: value.reshape(-1)[start:stop],
    cat=lambda values: torch.cat([v.reshape(-1) for v in values]),
    zeros=lambda like, numel: torch.zeros(numel, dtype=like.dtype, device=like.device),
)


def refuse_unshardable(optimizer, op_is_adasum):
    """Raise ValueError, with the reason, when ``optimizer`` or ``op`` cannot be sharded."""
    if op_is_adasum:
        raise ValueError("sharded=True does not take op=Adasum: Adasum combines whole parameter updates, and a "
                         "rank of a sharded optimizer computes the update of its slice only")
    for cls in type(optimizer).__mro__:
        if cls.__name__ in _REFUSED and cls.__module__.startswith("torch.optim"):
            raise ValueError(f"sharded=True cannot shard torch.optim.{cls.__name__}: {_REFUSED[cls.__name__]}; "
                             + _ELEMENTWISE_ONLY)


def _per_element(shapes):
    """Whether a consolidated state value holds one entry per element of parameter ``index``: it has the
    parameter's shape (a 0-d ``step`` of a 0-d parameter is shard-wide)."""

    def per_element(index, key, value):
        if not torch.is_tensor(value) or tuple(value.shape) != shapes[index]:
            return False
        return value.dim() > 0 or key != "step"

    return per_element


class _ShardedOptimizer:
    """Mixed in before ``rvod.torch.optimizer._DistributedOptimizer`` (whose gradient hooks and bookkeeping
    it reuses, reducing into shards) and the wrapped optimizer's class; see the module docstring."""

    def _shard(self):
        """Replace the parameters of the groups by this rank's shards, for the current world (again after an
        elastic reset; the state starts empty); the model's parameters stay in ``self._model_params`` (index
        -> parameter, the positions of a plain optimizer's state dict)."""
        self._abandon_gather()
        included = self._process_set.included()
        size = self._process_set.size() if included else 1
        rank = self._process_set.rank() if included else 0
        if not hasattr(self, "_model_groups"):
            self._model_groups = [list(group["params"]) for group in self.param_groups]
        self._model_params, params = {}, []
        self._group_sizes = [len(group) for group in self._model_groups]
        index = 0
        for g, group in enumerate(self._model_groups):
            for p in group:
                self._model_params[index] = p
                if p.requires_grad:
                    params.append(Param(index, g, p.numel(), str(p.dtype).removeprefix("torch.")))
                index += 1
        self._layout = ShardLayout(params, size, rank)
        self._single = not included or size == 1
        self._index_of = {p: i for i, p in self._model_params.items()}
        self._shapes = {i: tuple(p.shape) for i, p in self._model_params.items()}
        self._shards, self._grads, self._shard_of = [], [], {}
        by_group = {g: [] for g in range(len(self.param_groups))}
        with torch.no_grad():
            for shard in self._layout.shards:
                flat = torch.nn.Parameter(self._read_shard(shard, torch.empty(shard.numel, dtype=self._dtype(shard),
                                                                              device=self._device(shard))))
                for piece in shard.pieces:
                    self._shard_of[self._model_params[piece.param.index]] = len(self._shards)
                self._shards.append(flat)
                self._grads.append(torch.zeros_like(flat))
                by_group[shard.group].append(flat)
        for g, group in enumerate(self.param_groups):
            group["params"] = by_group[g]  # the same dicts: LR schedulers of the wrapped optimizer still apply
        # What every step allgathers: each parameter's chunk, a view of its shard (made once per layout).
        self._gathered = [self._model_params[piece.param.index] for shard in self._layout.shards
                          for piece in shard.pieces]
        self._chunks = [flat.detach()[piece.offset:piece.offset + piece.stop - piece.start]
                        for shard, flat in zip(self._layout.shards, self._shards) for piece in shard.pieces]
        self._grad_views = {}  # parameter -> the part of its shard's gradient buffer its reduced chunk goes to
        for index, piece in self._layout.piece_of.items():
            p = self._model_params[index]
            self._grad_views[p] = self._grads[self._shard_of[p]][piece.offset:piece.offset + piece.stop - piece.start]
        self._gather_name = f"sharded.parameters.{self._parameter_names[self._gathered[0]]}" if self._gathered else ""
        self.state = collections.defaultdict(dict)
        parameter_gathers.watch(p for p in self._model_params.values() if p.requires_grad)
        self._loaded_whole = None  # a consolidated dict loaded here, until broadcast_optimizer_state sends it

    def _dtype(self, shard):
        return self._model_params[shard.pieces[0].param.index].dtype

    def _device(self, shard):
        return self._model_params[shard.pieces[0].param.index].device

    def _read_shard(self, shard, out):
        """Copy this rank's chunks of the parameters into ``out`` (the shard's flat tensor)."""
        for piece in shard.pieces:
            flat = self._model_params[piece.param.index].detach().reshape(-1)
            out[piece.offset:piece.offset + piece.stop - piece.start].copy_(flat[piece.start:piece.stop])
        return out

    def _grad_view(self, p):
        """The part of its shard's gradient buffer that receives ``p``'s reduced chunk."""
        return self._grad_views[p]

    # ------------------------------------------------------------------------ reduce-scatter the gradients

    def _dense_flat(self, p):
        grad = self._gradient(p)
        if grad.is_sparse:
            if not self._sparse_as_dense:
                raise ValueError(f"sharded=True cannot shard the sparse gradient of {self._parameter_names[p]}: "
                                 "its rows are spread over every rank's slice; pass sparse_as_dense=True")
            grad = grad.to_dense()
        p.grad = None  # ZeRO-2: the engine keeps what it sends alive until the reducescatter completes
        return self._compression.compress(grad.reshape(-1))

    def _alone(self):
        return self._single  # of the current layout (``_shard``)

    def _start_parameter(self, p):
        compressed, context = self._dense_flat(p)
        if self._alone():
            return lambda: self._grad_view(p).copy_(self._compression.decompress(compressed, context))
        view = self._grad_view(p)
        # Uncompressed in host memory: the engine writes the reduced chunk straight into the shard's gradient.
        into = (self._compression.decompress is NoneCompressor.decompress and compressed.dtype == view.dtype
                and compressed.is_cpu and view.is_cpu)
        handle = reducescatter_async(compressed, name=f"sharded.{self._parameter_names[p]}", op=self._op,
                                     process_set=self._process_set, prescale_factor=self._scale[0],
                                     postscale_factor=self._scale[1], output=view if into else None)
        if into:
            return lambda: synchronize(handle)

        def finish():
            self._grad_view(p).copy_(self._compression.decompress(synchronize(handle), context))

        return finish

    def _start_group(self, group):
        members = [(p, *self._dense_flat(p)) for p in group]
        if self._alone():
            def finish_alone():
                for p, compressed, context in members:
                    self._grad_view(p).copy_(self._compression.decompress(compressed, context))

            return finish_alone
        handle = grouped_reducescatter_async([compressed for _, compressed, _ in members],
                                             name=f"sharded.{self._parameter_names[group[0]]}", op=self._op,
                                             process_set=self._process_set, prescale_factor=self._scale[0],
                                             postscale_factor=self._scale[1])

        def finish():
            for (p, _, context), reduced in zip(members, synchronize(handle)):
                self._grad_view(p).copy_(self._compression.decompress(reduced, context))

        return finish

    def synchronize(self):
        """Finish reducing every gradient into the shards' ``.grad`` (the model's ``p.grad`` is dropped)."""
        self.wait_for_parameters()
        super().synchronize()
        for flat, grad in zip(self._shards, self._grads):
            flat.grad = grad

    # ------------------------------------------------------------------------------- step and allgather

    def step(self, closure=None):
        self.wait_for_parameters()  # the last step's, when no forward read them (unused parameters)
        with torch.no_grad():
            for shard, flat in zip(self._layout.shards, self._shards):
                self._read_shard(shard, flat.data)
        loss = super().step(closure)
        self._start_gather()
        self._loaded_whole = None
        return loss

    def _start_gather(self):
        """Start allgathering every parameter's updated chunks (one grouped allgather, fused by the engine);
        ``wait_for_parameters`` writes them into the parameters."""
        if not self._chunks:
            return
        if self._alone():
            self._write_parameters(self._gathered, self._chunks)
            return
        handle = grouped_allgather_async(self._chunks, name=self._gather_name, process_set=self._process_set)
        self._gather = (handle, self._gathered)
        parameter_gathers.gathering.add(self)

    def wait_for_parameters(self):
        """Finish the allgather of the parameters the last ``step()`` started, writing them. A module's forward
        or state dict does it (``rvod.torch.parameter_gathers``); call it before reading ``p`` itself."""
        gather, self._gather = getattr(self, "_gather", None), None
        parameter_gathers.gathering.discard(self)
        if gather is not None:
            handle, params = gather
            self._write_parameters(params, synchronize(handle), adopt=True)

    def _abandon_gather(self):
        """Elastic restore or reset: finish the allgather in flight if the world still can, else drop it (the
        parameters are restored or resharded next)."""
        try:
            self.wait_for_parameters()
        except Exception:  # noqa: BLE001 - the old world died; its collectives fail, and nothing waits on them
            pass

    @staticmethod
    def _write_parameters(params, values, adopt=False):
        """Write the gathered ``values`` into ``params``. With ``adopt`` (``values`` are the allgather's own
        results, used nowhere else) a contiguous CPU parameter takes its result as its memory instead of a
        copy of it (as FSDP swaps its parameters' storage: a copy of the whole model per step saved, and its
        old memory goes back to rvod's buffer pool, where the next step's allgather finds it). GPU parameters
        are copied into (a device copy is cheap, and CUDA graphs need their parameters to stay put)."""
        with torch.no_grad():
            for p, flat in zip(params, values):
                if adopt and p.device.type == "cpu" and p.is_contiguous() and flat.is_contiguous() \
                        and flat.dtype == p.dtype and flat.device == p.device and flat.numel() == p.numel():
                    p.data = flat.view(p.shape)
                elif p.is_contiguous():
                    p.view(-1).copy_(flat)
                else:
                    p.copy_(flat.view(p.shape))

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """``torch.nn.utils.clip_grad_norm_`` for a sharded optimizer, whose model has no ``p.grad`` left: scale
        the reduced gradients of the shards so that the norm of the whole model's gradient is at most
        ``max_norm``; returns that norm (before clipping, the same on every rank). One allreduce of a scalar.
        Call it between ``synchronize()`` and a ``step()`` inside ``skip_synchronize()``, as with a plain
        ``DistributedOptimizer``::

            loss.backward()
            optimizer.synchronize()
            optimizer.clip_grad_norm_(1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        if not self._synchronized:
            raise RuntimeError("clip_grad_norm_() clips reduced gradients: call optimizer.synchronize() first, then "
                               "optimizer.step() inside optimizer.skip_synchronize()")
        norm_type = float(norm_type)
        grads = [flat.grad for flat in self._shards if flat.grad is not None]
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            op = Max
        else:
            local = sum(float(g.double().abs().pow(norm_type).sum()) for g in grads)
            op = Sum
        total = local if self._alone() else float(allreduce(torch.tensor(local, dtype=torch.float64), op=op,
                                                              name="sharded.clip_grad_norm",
                                                              process_set=self._process_set))
        if norm_type != float("inf"):
            total **= 1.0 / norm_type
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot "
                               "be clipped (error_if_nonfinite=True)")
        coefficient = min(max_norm / (total + 1e-6), 1.0)
        with torch.no_grad():
            for g in grads:
                g.mul_(coefficient)
        return torch.tensor(total)

    def _forget_reductions(self):
        self._abandon_gather()
        super()._forget_reductions()

    def zero_grad(self, set_to_none=True):
        """Clear the model's gradients (accumulated ones between reductions) and the shards'."""
        super().zero_grad(set_to_none)
        for p in self._model_params.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    # ------------------------------------------------------------------------------------- state dicts

    def state_dict(self):
        """This rank's shard state and the layout; ``consolidate_state_dict`` gives a plain optimizer's."""
        sharded = super().state_dict()
        sharded[SHARDED_KEY] = self._layout.describe()
        return sharded

    def _shard_states(self):
        return [dict(self.state.get(flat, {})) for flat in self._shards]

    def consolidate_state_dict(self, to=0):
        """The state dict a plain optimizer of the wrapped class would have for the whole model, returned on
        rank ``to`` (a global rank; None elsewhere), or on every rank when ``to`` is None. Collective: every
        rank of the process set calls it."""
        mine = (self._layout.describe(), self._shard_states())
        everyone = [mine] if self._alone() else allgather_object(mine, name="sharded.consolidate",
                                                                 process_set=self._process_set)
        if to is not None and rank() != to:
            return None
        return self._consolidated(everyone)

    def _consolidated(self, everyone):
        layouts = [ShardLayout.from_description(description) for description, _ in everyone]
        joined = join_shards(layouts, [states for _, states in everyone], _OPS)
        state = {}
        for index, entry in joined.items():
            numel = self._model_params[index].numel()
            # Per-element values come back flat (reshaped here); shard-wide ones are copied for each parameter.
            state[index] = {key: (value.reshape(self._shapes[index]) if _OPS.is_per_element(value, numel)
                                  else value.clone()) if torch.is_tensor(value) else value
                            for key, value in entry.items()}
        groups, index = [], 0
        for group, count in zip(self.param_groups, self._group_sizes):
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + count))})
            index += count
        return {"state": state, "param_groups": groups}

    def _broadcast_state(self, root_rank):
        """``broadcast_optimizer_state``: every rank takes the root's group options, and its shards of a
        consolidated state dict loaded on the root alone (each rank's own shard state is its own)."""
        sent = broadcast_object(([{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                                 self._loaded_whole) if rank() == root_rank else None,
                                root_rank, name="sharded.optimizer_state")
        options, whole = sent
        if whole is not None:
            self._load_whole(whole)
        for group, group_options in zip(self.param_groups, options):
            group.update(group_options)
        self._loaded_whole = None

    def load_state_dict(self, state_dict):
        """Load a consolidated state dict (a plain optimizer's), this rank's sharded one, or the list of every
        rank's sharded dicts of a job of any size, resharding it to this job."""
        if isinstance(state_dict, (list, tuple)):
            everyone = [(sd[SHARDED_KEY], _inner_states(sd)) for sd in state_dict]
            return self._load_whole(self._consolidated(everyone))
        if SHARDED_KEY in state_dict:
            check_own_shard(state_dict[SHARDED_KEY], self._layout)
            inner = {k: v for k, v in state_dict.items() if k != SHARDED_KEY}
            return super().load_state_dict(inner)
        self._load_whole(state_dict)
        self._loaded_whole = state_dict

    def _load_whole(self, whole):
        """Load this rank's shards of a consolidated state dict."""
        groups = whole["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        joined = {int(index): entry for index, entry in whole["state"].items()}
        states = split_params(joined, self._layout, _OPS, _per_element(self._shapes))
        inner_state = {i: {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}
                       for i, state in enumerate(states) if state}
        position, inner_groups = 0, []
        for group, saved in zip(self.param_groups, groups):
            count = len(group["params"])
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                 "params": list(range(position, position + count))})
            position += count
        super().load_state_dict({"state": inner_state, "param_groups": inner_groups})


def _inner_states(sharded):
    """The shard states of a sharded state dict, in shard order (``{}`` for a shard without state)."""
    count = sum(len(group["params"]) for group in sharded["param_groups"])
    return [dict(sharded["state"].get(i, {})) for i in range(count)]
