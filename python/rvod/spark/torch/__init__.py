"""horovod.spark.torch for rvod: ``TorchEstimator`` fits a PyTorch model to a Spark DataFrame on
``num_proc`` ranks and returns a ``TorchModel`` (a Spark Transformer). Needs pyspark, pyarrow and torch.

Submodules: ``estimator`` (the Estimator and Model), ``remote`` (what each rank runs).
"""

from rvod.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
