"""Train a small CNN on scikit-learn's digits data with rvod.torch on Spark tasks (horovod.spark's run).

    python examples/spark_torch_digits.py                                 # Spark in local mode, 2 ranks
    python examples/spark_torch_digits.py --master spark://host:7077 -np 4

The ranks are the tasks of one barrier stage; the training function is in cluster_digits.py. Spark 4
needs Java 17 or 21 (JAVA_HOME or java on PATH) and the executors need this Python's packages (torch,
scikit-learn, rvod); PYSPARK_PYTHON defaults to this interpreter here.
"""

import argparse
import os
import sys

import cloudpickle
from pyspark.sql import SparkSession

import cluster_digits
import rvod.spark


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    parser.add_argument("-np", "--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master(args.master).appName("rvod digits").getOrCreate()
    cloudpickle.register_pickle_by_value(cluster_digits)  # the executors need not have this directory
    try:
        results = rvod.spark.run(cluster_digits.train_digits, kwargs={"epochs": args.epochs},
                                 num_proc=args.num_proc, stdout=sys.stdout, stderr=sys.stderr)
    finally:
        spark.stop()
    cluster_digits.report(results)


if __name__ == "__main__":
    main()
