"""The exception tree every rvod module raises.

``RvodInternalError`` means a collective failed (a peer died, a link broke, the job shut down); elastic
training recovers from it, and ``HorovodInternalError`` is the same class so Horovod scripts catch it.
``RvodMismatchError`` means ranks disagreed about a tensor (shape, dtype, op, root): a bug in the script,
so it is not an ``RvodInternalError`` (elastic training would retry it forever); it is a ``ValueError``, and a
``RuntimeError`` as Horovod's PyTorch errors are, so ``except RuntimeError`` still catches it.
``RvodTimeoutError`` means a peer made no progress in time, or ranks never came to ``init()``.
``RvodInvalidArgumentError`` means a collective was refused when it was submitted (an op the collective
cannot do, such as Adasum in reducescatter; bad alltoall splits; a root or process set this rank cannot use;
a name already in flight; no ``init()``): nothing was sent and the refused call used no name. It is a
``ValueError`` as rvod's argument errors are, and a ``RuntimeError`` as Horovod raises these from its C++
checks, so ``except RuntimeError`` (Horovod's callers) and ``except ValueError`` both catch it.
Arguments of the wrong type raise plain ``TypeError``.
"""


class RvodError(Exception):
    """Base class of every rvod-specific error."""


class RvodInternalError(RvodError, RuntimeError):
    """A collective failed on this rank; the message says which op, which tensor and which peer."""


HorovodInternalError = RvodInternalError


class RvodMismatchError(RvodError, ValueError, RuntimeError):
    """Ranks disagreed about a tensor; the message names the ranks and the values they sent."""


class RvodInvalidArgumentError(RvodError, ValueError, RuntimeError):
    """A collective refused at submission, before anything was sent; the message says what and why."""


class RvodTimeoutError(RvodInternalError):
    """A peer made no progress for RVOD_TIMEOUT seconds, or ranks did not come to init() within
    RVOD_START_TIMEOUT (the message names them)."""


class HostsUpdatedInterrupt(RvodError, RuntimeError):
    """The hosts of an elastic job changed (raised by ``state.commit()`` / ``check_host_updates()`` on every rank
    at once): ``hvd.elastic.run`` resets the job to its new world without restoring the last commit, and
    synchronises the state from rank 0 unless hosts were only removed (``skip_sync``)."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync
