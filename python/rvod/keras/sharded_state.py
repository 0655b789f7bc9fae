"""The state of a Keras sharded ``DistributedOptimizer`` (``rvod.keras.sharded_optimizer``): checkpoints,
consolidation, resharding and broadcasts, as ``rvod.torch.sharded_optimizer`` has them, on
``rvod.common.sharding``'s layout and state moves.

The optimizer's variables are of two kinds: *slots* (made by the wrapped optimizer from a shard: Adam's
moments), this rank's alone, and *globals* (``iteration``, a learning-rate variable), the same on every rank.

- ``state_dict()``: this rank's slots (per shard, ``{slot name: array}``), the globals and the layout (under
  ``SHARDED_KEY``), as NumPy arrays.
- ``consolidate_state_dict(to=0)``: on rank ``to`` (every rank with None) the list of values a plain optimizer
  of the wrapped class and config has as ``variables`` once built on the model's trainable variables, so
  ``plain.build(model.trainable_variables); plain.set_weights(values)`` loads it. Collective.
- ``load_state_dict(x)``: such a consolidated list, this rank's ``state_dict()``, or the list of every rank's
  ``state_dict()`` of a job of any size (resharded here). The optimizer must be built.
- ``model.save()`` (Keras calls ``save_own_variables``): a plain optimizer's variables for the whole model, so
  ``keras.models.load_model`` gives a plain optimizer with the whole state and ``hvd.load_model(path,
  sharded=True)`` a sharded one. On one rank that is this rank's state; on more, the other ranks' slices are
  needed: ``consolidate_state_dict(to=r)``, called on every rank, keeps its result on rank r for the next
  ``model.save()`` there (while no step was taken since); without it ``model.save()`` raises ValueError
  saying so. ``load_own_variables`` (``model.load_weights`` of a ``.keras`` file) takes such values, resharded.
- ``broadcast_state(root_rank)`` (what ``broadcast_global_variables`` and ``BroadcastGlobalVariablesCallback``
  do for a sharded optimizer): the root's globals, and a consolidated list loaded on the root alone; each
  rank's slots are its own. ``broadcast_variables`` leaves slots out (``is_sharded_slice``).

Which plain variable holds which slot is found by building the wrapped class on the model's variables with
its slot creation recorded, not allocated (``_plain_order``).
"""

import weakref

import keras
import numpy as np

from rvod.common.objects import allgather_object, broadcast_object
from rvod.common.sharding import (SHARDED_KEY, ShardLayout, StateOps, check_own_shard, join_shards,
                                  split_params)

_OPS = StateOps(
    is_per_element=lambda value, numel: isinstance(value, np.ndarray) and value.ndim == 1 and value.size == numel,
    flat_slice=lambda value, start, stop: value.reshape(-1)[start:stop],
    cat=lambda values: np.concatenate([v.reshape(-1) for v in values]),
    zeros=lambda like, numel: np.zeros(numel, dtype=like.dtype),
)

_slices = weakref.WeakValueDictionary()  # id -> slot variable of a sharded optimizer


def is_sharded_slice(variable):
    """Whether ``variable`` is a slot of a sharded optimizer (this rank's slice, not to be broadcast)."""
    return _slices.get(id(variable)) is variable


def _array(variable):
    return np.array(variable.numpy(), copy=True)


class ShardedState:
    """Mixed into ``rvod.keras.sharded_optimizer._ShardedOptimizer``; see the module docstring."""

    def _rvod_watch_slots(self):
        for variable in self._rvod_built:
            if id(variable) in self._rvod_slot_of:
                _slices[id(variable)] = variable

    def _rvod_slots(self):
        return [v for v in self._rvod_built if id(v) in self._rvod_slot_of]

    def _rvod_globals(self):
        return [v for v in self.variables if id(v) not in self._rvod_slot_of]

    def _rvod_shard_states(self):
        states = [{} for _ in self._rvod_layout.shards]
        for variable in self._rvod_slots():
            shard, name = self._rvod_slot_of[id(variable)]
            states[shard][name] = _array(variable)
        return states

    def _rvod_require_built(self, what):
        if not self.built:
            raise ValueError(f"{what} needs the sharded optimizer built: call optimizer.build("
                             "model.trainable_variables) first")

    def state_dict(self):
        """This rank's slots, the globals and the layout (see the module docstring)."""
        self._rvod_require_built("state_dict()")
        return {"shards": self._rvod_shard_states(), "globals": [_array(v) for v in self._rvod_globals()],
                SHARDED_KEY: self._rvod_layout.describe()}

    def consolidate_state_dict(self, to=0):
        """The values of a plain optimizer's ``variables`` for the whole model, on rank ``to`` (a global rank;
        None elsewhere), or on every rank when ``to`` is None. Collective over the optimizer's process set."""
        from rvod.common.basics import rank

        mine = self.state_dict()
        everyone = [mine] if self._rvod_alone else allgather_object(
            mine, name="sharded.keras.consolidate", process_set=self._rvod_sharding["process_set"])
        if to is not None and rank() != to:
            return None
        values = self._rvod_consolidate(everyone)
        self.__dict__["_rvod_consolidated"] = (self._rvod_stamp(), values)  # for model.save() (save_own_variables)
        return values

    def _rvod_stamp(self):
        """What a consolidated state was taken at: the step and the layout."""
        return int(keras.ops.convert_to_numpy(self.iterations)), self._rvod_layout.size, self._rvod_layout.rank

    def _rvod_consolidate(self, everyone):
        joined, globals_ = self._rvod_join(everyone)
        values = []
        for kind, index, name in self._plain_order():
            if kind == "global":
                values.append(globals_[index])
                continue
            variable = self._rvod_model_variables[index]
            flat = joined.get(index, {}).get(name)
            values.append(np.zeros(variable.shape, dtype=str(variable.dtype)) if flat is None
                          else flat.reshape(variable.shape))
        return values

    def save_own_variables(self, store):
        """Keras' ``model.save()``: the variables of a plain optimizer for the whole model (see the module
        docstring); ValueError on more than one rank unless ``consolidate_state_dict(to=this rank)`` was
        called on every rank since the last step."""
        if not self.built:
            return super().save_own_variables(store)
        if self._rvod_alone:
            values = self._rvod_consolidate([self.state_dict()])
        else:
            stamp, values = self.__dict__.get("_rvod_consolidated") or (None, None)
            if stamp != self._rvod_stamp():
                from rvod.common.basics import rank

                raise ValueError(
                    f"model.save() with a sharded optimizer on {self._rvod_layout.size} ranks: rank {rank()} holds "
                    "its slice of the optimizer state only. Call optimizer.consolidate_state_dict(to=R) on every "
                    "rank (collective) after the last step, then model.save() on rank R saves the whole state "
                    "(loadable by a plain optimizer, or resharded by hvd.load_model(path, sharded=True)); or save "
                    "the weights alone (model.save_weights)")
        self.__dict__["_rvod_consolidated"] = None
        for i, value in enumerate(values):
            store[str(i)] = value

    def load_own_variables(self, store):
        """Keras' loading of a saved model's optimizer into this one: a plain optimizer's variables (what
        ``save_own_variables`` writes), resharded; Keras' warning, and nothing loaded, when it is not built."""
        if not self.built:
            return super().load_own_variables(store)
        self.load_state_dict([np.asarray(store[str(i)]) for i in range(len(store.keys()))])

    def _rvod_join(self, everyone):
        """Per-variable slots ``{variable index: {slot name: flat array}}`` and the globals (the lowest
        rank's) from every rank's ``state_dict()`` of one job."""
        layouts = [ShardLayout.from_description(sd[SHARDED_KEY]) for sd in everyone]
        joined = join_shards(layouts, [sd["shards"] for sd in everyone], _OPS)
        lowest = min(range(len(everyone)), key=lambda i: layouts[i].rank)
        return joined, list(everyone[lowest]["globals"])

    def _plain_order(self):
        """``[(kind, index, name)]`` for the ``variables`` of a plain optimizer of the wrapped class and config
        built on the model's variables: ``("slot", variable index, slot name)`` or ``("global", position among
        this optimizer's globals, None)``."""
        index_of = {id(v): i for i, v in enumerate(self._rvod_model_variables)}
        order = []

        class Recording(self._rvod_sharding["base"]):
            def add_variable_from_reference(probe, reference_variable, name=None, initializer="zeros"):
                order.append(("slot", index_of[id(reference_variable)], name or "var"))

            def add_variable(probe, *args, **kwargs):
                order.append(("global", None, None))
                return super().add_variable(*args, **kwargs)

        probe = Recording.from_config(self.get_config())
        order[:0] = [("global", None, None)] * len(probe.variables)  # made before build (iteration, ...)
        probe.build(self._rvod_model_variables)
        globals_ = [i for i, entry in enumerate(order) if entry[0] == "global"]
        if len(globals_) != len(self._rvod_globals()):
            raise ValueError(f"cannot consolidate {type(self).__name__}: built on the shards it has "
                             f"{len(self._rvod_globals())} variables that are not per-element slots, and "
                             f"{len(globals_)} built on the model's variables")
        for position, i in enumerate(globals_):
            order[i] = ("global", position, None)
        return order

    def load_state_dict(self, state):
        """Load a consolidated list (``consolidate_state_dict()``, or a plain optimizer's variables' values),
        this rank's ``state_dict()``, or the list of every rank's ``state_dict()`` of a job of any size,
        resharded here."""
        self._rvod_require_built("load_state_dict()")
        if isinstance(state, dict):
            if SHARDED_KEY not in state:
                raise ValueError("load_state_dict() takes a sharded optimizer's state_dict(), the list of every "
                                 "rank's, or a consolidated list of values (consolidate_state_dict())")
            check_own_shard(state[SHARDED_KEY], self._rvod_layout)
            self._rvod_load(None, list(state["globals"]), own=state["shards"])
            return
        if state and isinstance(state[0], dict):
            joined, globals_ = self._rvod_join(list(state))
        else:
            joined, globals_ = self._rvod_from_plain(list(state))
            self.__dict__["_rvod_loaded_whole"] = list(state)
        self._rvod_load(joined, globals_)

    def _rvod_from_plain(self, values):
        order = self._plain_order()
        if len(values) != len(order):
            raise ValueError(f"{len(values)} values given, and a plain {type(self).__name__} built on this model "
                             f"has {len(order)} variables")
        joined, globals_ = {}, [None] * sum(1 for kind, _, _ in order if kind == "global")
        for (kind, index, name), value in zip(order, values):
            value = np.asarray(value)
            if kind == "global":
                globals_[index] = value
            else:
                joined.setdefault(index, {})[name] = value.reshape(-1)
        return joined, globals_

    def _rvod_load(self, joined, globals_, own=None):
        """Assign this rank's slots (from per-variable ``joined``, or ``own`` shard states) and the globals."""
        states = own if own is not None else split_params(joined, self._rvod_layout, _OPS, lambda *_: True)
        for variable in self._rvod_slots():
            shard, name = self._rvod_slot_of[id(variable)]
            value = states[shard].get(name)
            variable.assign(np.zeros(variable.shape, dtype=str(variable.dtype)) if value is None else value)
        for variable, value in zip(self._rvod_globals(), globals_):
            variable.assign(value)

    def broadcast_state(self, root_rank=0):
        """Every rank takes ``root_rank``'s globals, and its slots of a consolidated list loaded on the root
        alone (each rank's own slots are its own). Collective over every rank."""
        from rvod.common.basics import rank

        self._rvod_require_built("broadcast_state()")
        root = rank() == root_rank
        sent = broadcast_object(([_array(v) for v in self._rvod_globals()], self.__dict__.get("_rvod_loaded_whole"))
                                if root else None, root_rank, name="sharded.keras.optimizer_state")
        globals_, whole = sent
        if whole is not None and not root:
            joined, _ = self._rvod_from_plain(whole)
            self._rvod_load(joined, globals_)
        for variable, value in zip(self._rvod_globals(), globals_):
            variable.assign(value)
        self.__dict__["_rvod_loaded_whole"] = None

    def _rvod_reshard(self, slices):
        """Lay the optimizer out for the current world and load the slices of every rank of the old one
        (``(layout description, shard states)``, in rank order), keeping the globals (elastic sync)."""
        globals_ = [_array(v) for v in self._rvod_globals()]
        joined = join_shards([ShardLayout.from_description(d) for d, _ in slices], [s for _, s in slices], _OPS)
        self._rvod_lay_out()
        self._rvod_load(joined, globals_)
