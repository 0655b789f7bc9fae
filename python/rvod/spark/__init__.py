"""Run rvod jobs on a Spark cluster with horovod.spark's ``run`` (barrier execution mode), and fit models to
DataFrames with horovod.spark's estimators.

Submodules: ``runner`` (``run``), ``rank_process`` (a rank's own process under its Spark task),
``preflight`` (checks the executors can import rvod), ``common`` (stores, backends, params and what the
estimators share), ``torch`` (``TorchEstimator``), ``keras`` (``KerasEstimator``). There is no
``rvod.spark.lightning``: Lightning 2 removed the Horovod strategy Horovod's Lightning estimator is built on
(see docs/spark-estimators.md).

Needs pyspark (``pip install pyspark``) and the Java that Spark needs (Spark 4: Java 17 or 21); the
estimators also need pyarrow. ``import rvod`` never imports them.
"""

from rvod.spark.runner import run

__all__ = ["run"]
