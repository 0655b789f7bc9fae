"""horovod.spark.keras for rvod: ``KerasEstimator`` fits a Keras 3 model to a Spark DataFrame on
``num_proc`` ranks and returns a ``KerasModel`` (a Spark Transformer). Needs pyspark, pyarrow and Keras 3
(TensorFlow backend).

Submodules: ``estimator`` (the Estimator and Model), ``remote`` (what each rank runs, and the model's
bytes as they travel).
"""

from rvod.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
