"""``DistributedOptimizer(..., sharded=True)`` for Keras 3 (TensorFlow backend): optimizer state sharded
across ranks (ZeRO-1/2).

The layout is ``rvod.common.sharding``'s, as in ``rvod.torch.sharded_optimizer``: each rank owns a balanced
chunk of every trainable variable. The wrapped optimizer is built, not on the model's variables, but on one
flat *shard* variable per dtype made of this rank's chunks, so its slots (Adam's moments) are this rank's
share only. ``apply()`` reduce-scatters the gradients (one grouped reducescatter: ``op``, scale factors and
compression keep their meaning; ``groups`` has no effect), reads the shards from the model's variables (so
``broadcast_variables`` or ``set_weights`` is seen), applies the wrapped optimizer to the shards, and
allgathers the updated chunks into the model's variables. Eagerly and inside Keras' ``tf.function``.

Refused, with the reason: ``op=Adasum``, the torch backend, ``clipnorm``/``global_clipnorm`` (they need
whole gradients; ``clipvalue`` is per element and works), ``use_ema``, and sparse gradients without
``sparse_as_dense``. Checkpoints of the sharded state (consolidation, resharding) are rvod.torch's only
for now.
"""

import keras
import numpy as np

from rvod.common.sharding import Param, ShardLayout
from rvod.keras.optimizer_base import KerasSpellings, refuse_xla


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


class _ShardedOptimizer(KerasSpellings):
    """Mixed in before the wrapped optimizer's class; see the module docstring. ``_rvod_sharding`` holds the
    reduction options (set by ``DistributedOptimizer``)."""

    _rvod_sharding = None

    def build(self, variables):
        import tensorflow as tf

        variables = list(variables)
        process_set = self._rvod_sharding["process_set"]
        included = process_set.included()
        size, rank = (process_set.size(), process_set.rank()) if included else (1, 0)
        layout = ShardLayout([Param(i, 0, int(np.prod(v.shape)), str(v.dtype)) for i, v in enumerate(variables)],
                             size, rank)
        # Bypass Keras' attribute tracking: the shards are the wrapped optimizer's "model", not its state.
        self.__dict__.update(_rvod_model_variables=variables, _rvod_layout=layout, _rvod_alone=not included or size == 1)
        shards = []
        for index, shard in enumerate(layout.shards):
            with tf.init_scope():
                shards.append(keras.Variable(self._rvod_read(shard), dtype=shard.dtype, name=f"rvod_shard_{index}"))
        self.__dict__["_rvod_shards"] = shards
        super().build(shards)

    def _rvod_read(self, shard, chunks=None):
        """The shard's 1-D value: this rank's chunks of the model's variables, or ``chunks`` (variable index ->
        this rank's chunk of some per-variable value) joined."""
        import tensorflow as tf

        parts = [chunks[piece.param.index] if chunks is not None else
                 tf.reshape(self._rvod_model_variables[piece.param.index], [-1])[piece.start:piece.stop]
                 for piece in shard.pieces]
        return tf.concat(parts, 0) if parts else tf.zeros([0], dtype=shard.dtype)

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None and not self.built:
            self.build(trainable_variables)
            self.built = True
        refuse_xla()
        shard_grads = self._rvod_reduce_scatter(list(grads))
        for shard, variable in zip(self._rvod_layout.shards, self._rvod_shards):
            variable.assign(self._rvod_read(shard))
        super().apply(shard_grads, self._rvod_shards)
        self._rvod_gather()

    def _rvod_reduce_scatter(self, grads):
        """Each shard's reduced gradient: this rank's chunk of every variable's reduced gradient."""
        import tensorflow as tf

        from rvod.tensorflow.mpi_ops import grouped_reducescatter

        options = self._rvod_sharding
        flat = []
        for variable, grad in zip(self._rvod_model_variables, grads):
            if grad is None:
                grad = tf.zeros_like(variable)
            elif isinstance(grad, tf.IndexedSlices):
                if not options["sparse_as_dense"]:
                    raise ValueError(f"sharded=True cannot shard the sparse gradient of {variable.path}: its rows "
                                     "are spread over every rank's slice; pass sparse_as_dense=True")
                grad = tf.convert_to_tensor(grad)
            flat.append(tf.reshape(grad, [-1]))
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
