"""``rvod.tensorflow.keras.callbacks`` is ``rvod.keras.callbacks``."""

from rvod.keras.callbacks import (  # noqa: F401
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    broadcast_variables,
)
