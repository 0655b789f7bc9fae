"""DistributedOptimizer with ``op=Adasum`` (Horovod's ``_DistributedAdasumOptimizer``): ranks combine
their parameter *updates* with Adasum instead of averaging gradients.

When a parameter's gradient is complete (on the last of ``backward_passes_per_step`` backward passes), its
hook remembers the parameter's value, runs the wrapped optimizer's step for that parameter alone, turns the
parameter into its update (new value - old value) and starts an in-place Adasum allreduce of the update,
named after the parameter. ``step()`` steps and reduces the parameters no hook reached, waits for every
reduction and sets each parameter to its old value plus the combined update, the same on every rank.
``synchronize()`` does nothing (there are no gradients to reduce) and ``skip_synchronize()`` is refused.
"""

import contextlib

import torch

from rvod.common.gradients import check_backward_passes_per_step
from rvod.common.reduce_ops import Adasum
from rvod.torch.mpi_ops import allreduce_async_, synchronize


class _DistributedAdasumOptimizer:
    """Mixed in before the wrapped optimizer's class; see the module docstring."""

    def _setup(self, parameter_names, compression, backward_passes_per_step, process_set):
        self._compression = compression
        self._process_set = process_set
        self._parameter_names = parameter_names
        self._requires_update = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._starts = {p: torch.zeros_like(p, requires_grad=False) for p in self._requires_update}
        self._pending = {}
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._hook_handles = []
        if process_set.included():
            self._hook_handles = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                                  for p in self._requires_update]

    def _gradient_ready(self, p):
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._pending[p] = self._start(p)

    def _step_only(self, p):
        """The wrapped optimizer's step applied to ``p`` alone (its state and options are ``p``'s group's)."""
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            super().step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params

    def _start(self, p):
        """Step ``p`` locally, make it hold its update and start combining that update across ranks."""
        start = self._starts[p]
        with torch.no_grad():
            start.copy_(p)
            self._step_only(p)
            p.data.sub_(start)
        compressed, context = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names[p], op=Adasum, process_set=self._process_set)
        return handle, context

    def set_backward_passes_per_step(self, passes):
        """Combine updates every ``passes`` backward passes (gradients accumulate locally in between)."""
        passes = check_backward_passes_per_step(passes)
        self.backward_passes_per_step = passes
        self._delay = {p: passes for p in self._requires_update}

    def synchronize(self):
        """Nothing to do: Adasum combines parameter updates in ``step()``, not gradients."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - makes this a generator for contextmanager

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._process_set.included():
            self._pending.clear()
            super().step()
            return loss
        for p in self._requires_update:
            if p not in self._pending:
                self._pending[p] = self._start(p)
        for p, (handle, context) in self._pending.items():
            delta = self._compression.decompress(synchronize(handle), context)
            with torch.no_grad():
                start = self._starts[p]
                start.add_(delta)
                p.data.copy_(start)
        self._pending.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        return loss

    def zero_grad(self, *args, **kwargs):
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super().zero_grad(*args, **kwargs)
