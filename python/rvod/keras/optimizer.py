"""DistributedOptimizer for Keras 3: the wrapped optimizer applies gradients reduced across ranks.

The object returned is an instance of a subclass of the wrapped optimizer's class with the same name (and
module, so a saved model names the plain optimizer), rebuilt from the wrapped optimizer's config as
Horovod does. Keras 3 funnels every gradient update through ``_clip_gradients`` right before the update
step; the subclass reduces the gradients there, before clipping, so clipping sees the averaged gradient.
With ``backward_passes_per_step`` N > 1 the optimizer's own gradient accumulation
(``gradient_accumulation_steps``) adds up N local gradients and calls ``_clip_gradients`` only on every
N-th step, so ranks exchange gradients once per N steps; the result is the sum of the N gradients, or
their mean with ``average_aggregated_gradients``. Works eagerly and inside Keras' ``tf.function`` train
step (not under XLA: compile with ``jit_compile=False``, the default on CPU).

Keras 2 spellings scripts written for Horovod use on the optimizer are accepted too: ``opt.variables()``
(``variables`` is a list that can also be called) and ``opt.lr`` (``learning_rate``).

With ``sharded=True`` the subclass mixes in ``rvod.keras.sharded_optimizer`` instead, which shards the
optimizer state across the ranks and accumulates the N gradients itself (then reduce-scatters their sum once).
"""

import keras

from rvod.common.gradients import Reduction, check_backward_passes_per_step, refuse_rewrapping
from rvod.common.process_sets import global_process_set
from rvod.common.reduce_ops import Adasum, Average
from rvod.keras.adasum_optimizer import DistributedAdasumOptimizer
from rvod.keras.compression import Compression
from rvod.keras.optimizer_base import KerasSpellings, refuse_xla
from rvod.keras.sharded_optimizer import _ShardedOptimizer, refuse_unshardable


def gradient_reducer(backend, **options):
    """The gradient reducer for tensors of the given Keras backend."""
    if backend == "tensorflow":
        from rvod.tensorflow.gradients import GradientReducer

        return GradientReducer(**options)
    if backend == "torch":
        from rvod.keras.torch_gradients import TorchGradientReducer

        return TorchGradientReducer(**options)
    raise NotImplementedError(f"rvod.keras supports the tensorflow and torch backends of Keras, not {backend!r}")


class _DistributedOptimizer(KerasSpellings):
    """Mixed in before the wrapped optimizer's class; see the module docstring."""

    _rvod_reducer = None
    _rvod_variables = None

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Bypass Keras' attribute tracking, which would count these variables as the optimizer's own.
        self.__dict__["_rvod_variables"] = list(trainable_variables)
        return super()._backend_apply_gradients(grads, trainable_variables)

    def _clip_gradients(self, grads):
        refuse_xla()
        return super()._clip_gradients(self._rvod_reducer(list(grads), self._rvod_variables))

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not exchanged)."""
        self._rvod_reducer.register_local_variable(var)


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True, sharded=False):
    """Wrap a Keras 3 optimizer so that it applies gradients averaged (``op``: Average or Sum) across the
    ranks of ``process_set``, or (``op=Adasum``) combines each step's parameter updates with Adasum
    (``rvod.keras.adasum_optimizer``). Arguments are Horovod's; ``device_dense``/``device_sparse`` are
    ignored. ``sharded=True`` shards the optimizer state across the ranks (``rvod.keras.sharded_optimizer``)."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    refuse_rewrapping(optimizer, (_DistributedOptimizer, DistributedAdasumOptimizer, _ShardedOptimizer))
    backward_passes_per_step = check_backward_passes_per_step(backward_passes_per_step)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    steps = backward_passes_per_step
    if steps > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("use either backward_passes_per_step or the optimizer's gradient_accumulation_steps, "
                             "not both")
        config["gradient_accumulation_steps"] = steps
    elif config.get("gradient_accumulation_steps"):
        steps = config["gradient_accumulation_steps"]
        average_aggregated_gradients = True  # the optimizer's own accumulation averages
    # Keras' accumulation hands over the mean of the accumulated gradients; Horovod sums them by default.
    postscale = 1.0 if average_aggregated_gradients else float(steps)
    adasum = op == Adasum
    if sharded:
        refuse_unshardable(optimizer, adasum)
        # The sharded optimizer accumulates whole gradients itself, then reduces their sum once.
        config["gradient_accumulation_steps"] = None
    # Adasum reduces parameter updates, not gradients: no postscale, and a local variable keeps its own.
    reducer = gradient_reducer(keras.backend.backend(), compression=compression, sparse_as_dense=sparse_as_dense,
                               op=op, gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients and not adasum,
                               postscale_factor=1.0 if adasum else postscale, allow_adasum=adasum)
    base = type(optimizer)
    mixin = _ShardedOptimizer if sharded else DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    distributed = cls.from_config(config)
    distributed._rvod_reducer = reducer
    if sharded:
        scale = Reduction(op, gradient_predivide_factor, postscale_factor=postscale / steps)
        distributed._rvod_sharding = dict(compression=compression, op=scale.op, prescale_factor=scale.prescale_factor,
                                          postscale_factor=scale.postscale_factor, process_set=process_set,
                                          sparse_as_dense=sparse_as_dense, passes=steps, base=base)
    if adasum:
        distributed._rvod_gradient_scale = postscale
    distributed.backward_passes_per_step = backward_passes_per_step
    return distributed
