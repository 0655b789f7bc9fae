"""``DistributedOptimizer(..., sharded=True)`` for Keras 3 (TensorFlow backend): optimizer state sharded
across ranks (ZeRO-1/2).

The layout is ``rvod.common.sharding``'s, as in ``rvod.torch.sharded_optimizer``: each rank owns a balanced
chunk of every trainable variable. The wrapped optimizer is built, not on the model's variables, but on one
flat *shard* variable per dtype made of this rank's chunks, so its slots (Adam's moments) are this rank's
share only. ``apply()`` reduce-scatters the gradients (one grouped reducescatter: ``op``, scale factors and
compression keep their meaning; ``groups`` has no effect), reads the shards from the model's variables (so
``broadcast_variables`` or ``set_weights`` is seen), applies the wrapped optimizer to the shards, and
allgathers the updated chunks into the model's variables. Eagerly and inside Keras' ``tf.function``.

``backward_passes_per_step`` N > 1 (or the optimizer's own ``gradient_accumulation_steps``) keeps its
meaning: each rank adds up its gradients locally for N passes (whole variables, as a plain optimizer's
accumulators do), and every N-th pass reduce-scatters the sum once and steps; ``iterations`` counts steps.

Checkpoints, broadcasts and elastic re-layouts are ``rvod.keras.sharded_state``'s. Refused, with the
reason: ``op=Adasum``, the torch backend, ``clipnorm``/``global_clipnorm`` (they need whole gradients;
``clipvalue`` is per element and works), ``use_ema``, Adafactor, and sparse gradients without
``sparse_as_dense``.
"""

import keras
import numpy as np

from rvod.common.sharding import Param, ShardLayout
from rvod.keras.optimizer_base import KerasSpellings, refuse_xla
from rvod.keras.sharded_state import ShardedState


def refuse_unshardable(optimizer, op_is_adasum):
    """Raise ValueError, with the reason, when ``optimizer`` or ``op`` cannot be sharded."""
    if op_is_adasum:
        raise ValueError("sharded=True does not take op=Adasum: Adasum combines whole parameter updates, and a "
                         "rank of a sharded optimizer computes the update of its slice only")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"sharded=True needs Keras' tensorflow backend, not {keras.backend.backend()!r}")
    for option in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, option, None):
            raise ValueError(f"sharded=True cannot take {option}: it needs the norm of whole gradients, and a rank "
                             "holds its slice only; clipvalue (per element) works")
    if getattr(optimizer, "use_ema", False):
        raise ValueError("sharded=True cannot take use_ema: the moving averages would be of the slices")
    if isinstance(optimizer, keras.optimizers.Adafactor):
        raise ValueError("sharded=True cannot shard Adafactor: it factors its state by the rows and columns of "
                         "whole variables")


class _ShardedOptimizer(ShardedState, KerasSpellings):
    """Mixed in before the wrapped optimizer's class; see the module docstring. ``_rvod_sharding`` holds the
    reduction options (set by ``DistributedOptimizer``): compression, op, scale factors, process set,
    sparse_as_dense, ``passes`` (backward passes per step) and ``base`` (the wrapped optimizer's class)."""

    _rvod_sharding = None

    def build(self, variables):
        if self.built:
            return
        # Bypass Keras' attribute tracking: the model's variables and the shards are not the optimizer's state.
        self.__dict__["_rvod_model_variables"] = list(variables)
        self._rvod_lay_out()

    def _rvod_lay_out(self):
        """Build the shards of the current world and the wrapped optimizer's state on them (again after an
        elastic reset: the variables the wrapped optimizer built are dropped, the others keep their values;
        the slots start at zero)."""
        import tensorflow as tf

        variables = self._rvod_model_variables
        process_set = self._rvod_sharding["process_set"]
        included = process_set.included()
        size, rank = (process_set.size(), process_set.rank()) if included else (1, 0)
        layout = ShardLayout([Param(i, 0, int(np.prod(v.shape)), str(v.dtype)) for i, v in enumerate(variables)],
                             size, rank)
        kept = []
        if self.built:
            kept = [np.array(v.numpy()) for v in self._rvod_built if id(v) not in self._rvod_slot_of]
            for variable in self._rvod_built:
                self._untrack_variable(variable)
            self.built = False
        shards = []
        for index, shard in enumerate(layout.shards):
            with tf.init_scope():
                shards.append(keras.Variable(self._rvod_read(shard), dtype=shard.dtype,
                                             name=f"rvod_shard_{index}"))
        with tf.init_scope():
            passes = self._rvod_sharding["passes"]
            accumulated = [tf.Variable(tf.zeros([p.numel], dtype=p.dtype), trainable=False) for p in layout.params] \
                if passes > 1 else []
            counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.__dict__.update(_rvod_layout=layout, _rvod_alone=not included or size == 1, _rvod_shards=shards,
                             _rvod_shard_index={id(v): s for s, v in enumerate(shards)}, _rvod_slot_of={},
                             _rvod_accumulated=accumulated, _rvod_passes=counter)
        before = {id(v) for v in self._variables}
        super().build(shards)
        self.__dict__["_rvod_built"] = [v for v in self._variables if id(v) not in before]
        for variable, value in zip([v for v in self._rvod_built if id(v) not in self._rvod_slot_of], kept):
            variable.assign(value)
        self._rvod_watch_slots()

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        variable = super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        shard = self.__dict__.get("_rvod_shard_index", {}).get(id(reference_variable))
        if shard is not None:
            self._rvod_slot_of[id(variable)] = (shard, name or "var")
        return variable

    def _rvod_read(self, shard, chunks=None):
        """The shard's 1-D value: this rank's chunks of the model's variables, or ``chunks`` (variable index ->
        this rank's chunk of some per-variable value) joined."""
        import tensorflow as tf

        parts = [chunks[piece.param.index] if chunks is not None else
                 tf.reshape(self._rvod_model_variables[piece.param.index], [-1])[piece.start:piece.stop]
                 for piece in shard.pieces]
        return tf.concat(parts, 0) if parts else tf.zeros([0], dtype=shard.dtype)

    def apply(self, grads, trainable_variables=None):
        import tensorflow as tf

        if trainable_variables is not None and not self.built:
            self.build(trainable_variables)
        refuse_xla()
        flat = self._rvod_flat(list(grads))
        if self._rvod_sharding["passes"] == 1:
            self._rvod_step(flat)
            return
        for accumulator, grad in zip(self._rvod_accumulated, flat):
            accumulator.assign_add(grad)
        self._rvod_passes.assign_add(1)

        def step():
            self._rvod_step([accumulator.read_value() for accumulator in self._rvod_accumulated])
            for accumulator in self._rvod_accumulated:
                accumulator.assign(tf.zeros_like(accumulator))
            self._rvod_passes.assign(0)
            return tf.constant(True)

        tf.cond(self._rvod_passes >= self._rvod_sharding["passes"], step, lambda: tf.constant(False))

    def _rvod_flat(self, grads):
        """The gradients dense and flat, zeros for a variable without one."""
        import tensorflow as tf

        flat = []
        for variable, grad in zip(self._rvod_model_variables, grads):
            if grad is None:
                grad = tf.zeros_like(variable)
            elif isinstance(grad, tf.IndexedSlices):
                if not self._rvod_sharding["sparse_as_dense"]:
                    raise ValueError(f"sharded=True cannot shard the sparse gradient of {variable.path}: its rows "
                                     "are spread over every rank's slice; pass sparse_as_dense=True")
                grad = tf.convert_to_tensor(grad)
            flat.append(tf.reshape(grad, [-1]))
        return flat

    def _rvod_step(self, flat):
        """Reduce-scatter the flat gradients, step the shards, allgather them into the model's variables."""
        shard_grads = self._rvod_reduce_scatter(flat)
        for shard, variable in zip(self._rvod_layout.shards, self._rvod_shards):
            variable.assign(self._rvod_read(shard))
        super().apply(shard_grads, self._rvod_shards)
        self._rvod_gather()

    def _rvod_reduce_scatter(self, flat):
        """Each shard's reduced gradient: this rank's chunk of every variable's reduced gradient."""
        from rvod.tensorflow.mpi_ops import grouped_reducescatter

        options = self._rvod_sharding
        if self._rvod_alone:  # one rank: the whole gradient is its chunk
            reduced = flat
        else:
            reduced = grouped_reducescatter(flat, compression=options["compression"], op=options["op"],
                                            prescale_factor=options["prescale_factor"],
                                            postscale_factor=options["postscale_factor"],
                                            process_set=options["process_set"])
        chunks = dict(enumerate(reduced))
        return [self._rvod_read(shard, chunks) for shard in self._rvod_layout.shards]

    def _rvod_gather(self):
        """Allgather every variable's updated chunks into it (one grouped allgather)."""
        import tensorflow as tf

        from rvod.tensorflow.mpi_ops import grouped_allgather

        pieces = [(piece, variable) for shard, variable in zip(self._rvod_layout.shards, self._rvod_shards)
                  for piece in shard.pieces]
        chunks = [variable[piece.offset:piece.offset + piece.stop - piece.start] for piece, variable in pieces]
        gathered = chunks if self._rvod_alone else grouped_allgather(
            chunks, process_set=self._rvod_sharding["process_set"])
        for (piece, _), value in zip(pieces, gathered):
            model_variable = self._rvod_model_variables[piece.param.index]
            model_variable.assign(tf.reshape(value, model_variable.shape))
