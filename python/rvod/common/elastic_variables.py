"""Elastic state made of framework variables, framework-neutral: ``VariablesState`` (NumPy copies of any
variables with ``assign``) and ``KerasModelState`` (a Keras model with its optimizer), the logic of
``rvod.tensorflow.elastic``'s and ``rvod.keras.elastic``'s states; each shim gives only how to read and
broadcast its variables.

Invariant: ``_tracked()`` lists the same variables in the same order on every rank, so ``sync()``'s
broadcast from rank 0 matches them one to one (an optimizer that has no variables yet is built first).
"""

import numpy as np

from rvod.common.elastic import ObjectState
from rvod.common.sharded_commits import ShardCommits


class VariablesState(ObjectState):
    """Framework variables (anything with ``assign``) and keyword arguments, committed together: ``save()``
    keeps NumPy copies of the variables' values, ``restore()`` assigns them back, ``sync()`` broadcasts rank
    0's values. A shim gives ``_tracked()`` (the variables, in the same order on every rank),
    ``_to_numpy(variable)`` and ``_broadcast(variables)`` (assign rank 0's values to them)."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._save_variables()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **kwargs)

    def _tracked(self):
        raise NotImplementedError

    def _to_numpy(self, variable):
        raise NotImplementedError

    def _broadcast(self, variables):
        raise NotImplementedError

    def _save_variables(self):
        self._saved_values = [np.array(self._to_numpy(v), copy=True) for v in self._tracked()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        variables = self._tracked()
        if len(variables) == len(self._saved_values):  # else nothing was committed for them yet
            for variable, value in zip(variables, self._saved_values):
                variable.assign(value)
        super().restore()

    def sync(self):
        variables = self._tracked()
        if variables:
            self._broadcast(variables)
        self._save_variables()
        super().sync()


class KerasModelState(VariablesState):
    """A built Keras model (Keras 3, or TensorFlow's tf.keras), its optimizer (default ``model.optimizer``)
    and keyword arguments, committed together: the logic of ``rvod.keras.elastic.KerasState`` and
    ``rvod.tensorflow.elastic.TensorFlowKerasState``. The model must be built (Horovod's ValueError
    otherwise). An optimizer that has not built its variables yet (Keras 3 builds them at the first step)
    is built from the model's trainable variables when the state first needs them, so a rank that has not
    trained yet, or joins a running job, has the same variables as rank 0 for ``sync()`` to fill.

    A sharded optimizer's slots (this rank's slice of its state) are not among the variables: a commit keeps
    this rank's slice and a buddy copy of another rank's (``rvod.common.sharded_commits``), ``hand_over()``
    gives a leaving rank's slice to a rank that stays, and ``sync()`` or ``relayout()`` lays the optimizer out
    for the new world with the slices of the last commit (a traced train function is dropped, to be traced
    again on the new shards)."""

    def __init__(self, model, optimizer=None, backend=None, bcast_object=None, get_rank=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **kwargs)
        sharded = self._sharded()
        self._shard_commits = None if sharded is None else ShardCommits(
            lambda: sharded._rvod_layout.describe(), sharded._rvod_shard_states)

    def _sharded(self):
        """The optimizer when it is a sharded DistributedOptimizer (``rvod.keras.sharded_optimizer``)."""
        return self.optimizer if getattr(self.optimizer, "_rvod_sharding", None) is not None else None

    def _tracked(self):
        optimizer = self.optimizer
        if optimizer is None:
            return list(self.model.variables)
        if not getattr(optimizer, "built", True):
            optimizer.build(self.model.trainable_variables)
        found = optimizer.variables
        slots = getattr(optimizer, "_rvod_slot_of", {}) if self._sharded() is not None else {}
        return list(self.model.variables) + [v for v in (found() if callable(found) else found) if id(v) not in slots]

    def save(self):
        if self._shard_commits is not None:  # first: the collective that may fail, leaving the last commit whole
            self._shard_commits.save()
        super().save()

    def hand_over(self, leaving):
        if self._shard_commits is not None:
            self._shard_commits.hand_over(leaving)

    def relayout(self):
        """Lay the sharded optimizer out for the new world, with the slices of the last commit (or hand-over)."""
        if self._shard_commits is not None:
            optimizer = self._sharded()
            before = (optimizer._rvod_layout.size, optimizer._rvod_layout.rank)
            slices = self._shard_commits.gather()
            optimizer._rvod_reshard(slices)
            self._shard_commits.restart(slices[0][0]["commit"])
            if (optimizer._rvod_layout.size, optimizer._rvod_layout.rank) != before:
                self.model.train_function = None  # traced on the old shards

    def sync(self):
        self.relayout()
        super().sync()
