"""Run rvod jobs on a Spark cluster with horovod.spark's ``run`` (barrier execution mode).

Needs pyspark (``pip install pyspark``) and the Java that Spark needs (Spark 4: Java 17 or 21);
``import rvod`` never imports it.
"""

from rvod.spark.runner import run

__all__ = ["run"]
