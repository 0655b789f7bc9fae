"""``rvod.tensorflow.keras`` is ``rvod.keras`` (one implementation): ``import rvod.tensorflow.keras as hvd``
in place of ``import horovod.tensorflow.keras as hvd``."""

from rvod.keras import *  # noqa: F401,F403
from rvod.keras import __all__, callbacks  # noqa: F401
