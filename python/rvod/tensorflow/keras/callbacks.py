"""``rvod.tensorflow.keras.callbacks`` is ``rvod.keras.callbacks``."""

from rvod.keras.callbacks import *  # noqa: F401,F403
from rvod.keras.callbacks import (  # noqa: F401
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
