"""Parameter allgathers in flight, and the hooks that wait for them before parameters are read.

A sharded ``DistributedOptimizer`` starts allgathering the updated parameters at the end of ``step()`` and
returns without waiting, so the allgather overlaps whatever runs before the parameters are next read (the
next batch, ``zero_grad()``, the forward up to the first module). It is waited for, and the parameters
written, by the first of:

- a module's forward: a global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``;
  a ``torch.compile``'d module runs it before its graph, not inside it);
- ``state_dict()`` or ``load_state_dict()`` of a module that holds such a parameter, itself or in a
  submodule (hooks put on every such module whose forward ran since the optimizer was made), so checkpoints
  see the gathered values and a loaded model state is not overwritten by a late allgather;
- ``hvd.broadcast_parameters``, and the optimizer's own ``step()``, ``synchronize()`` and elastic commits;
- ``optimizer.wait_for_parameters()``, which code reading ``p`` or ``p.data`` itself between ``step()``
  and the next forward must call first;
- ``hvd.shutdown()`` and the end of the process, so a rank whose script ends right after ``step()`` still
  serves the allgather to a rank that reads its parameters then (rank 0 saving a checkpoint).

An optimizer has its parameters looked after with ``watch(parameters)``; while its allgather is in flight
it is in ``gathering``, and its ``wait_for_parameters()`` finishes it.
"""

import weakref

import torch

from rvod.common.basics import finish_before_shutdown

gathering = weakref.WeakSet()  # optimizers whose parameter allgather is in flight
_watched = weakref.WeakValueDictionary()  # id -> parameter of a sharded optimizer (tensors compare by value)
_seen = weakref.WeakSet()  # modules the forward pre-hook has looked at since the last watch()
_hooked = weakref.WeakSet()  # modules with the state dict pre-hooks
_installed = []
# Whether torch.compile is tracing (``torch._dynamo.is_compiling`` before PyTorch 2.3 named it).
_compiling = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling


def wait_all():
    """Finish every parameter allgather in flight."""
    for optimizer in list(gathering):
        optimizer.wait_for_parameters()


def _on_state_dict(*_):
    wait_all()


def _before_forward(module, _inputs):
    if _compiling():
        return  # a compiled module's own call ran this hook before its graph
    if module not in _seen:
        _seen.add(module)
        if module not in _hooked and any(_watched.get(id(p)) is p for p in module.parameters()):
            _hooked.add(module)
            module.register_state_dict_pre_hook(_on_state_dict)
            module.register_load_state_dict_pre_hook(_on_state_dict)
    if gathering:
        wait_all()


def watch(parameters):
    """Install the hooks (once per process) and have them look after ``parameters``."""
    if not _installed:
        finish_before_shutdown(wait_all)  # another rank may still read its parameters (a checkpoint on rank 0)
        _installed.append(torch.nn.modules.module.register_module_forward_pre_hook(_before_forward))
    for p in parameters:
        _watched[id(p)] = p
    _seen.clear()  # modules that ran before may hold these
