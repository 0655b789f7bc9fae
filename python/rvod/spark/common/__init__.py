"""What the Spark estimators share (horovod.spark.common): ``store`` (where data, checkpoints and logs go),
``backend`` (how the ranks run: ``SparkBackend``), ``params`` (the estimators' and models' Spark ML params),
``data`` (DataFrame to Parquet in the store, Parquet row groups to each rank's batches), ``estimator`` (the
fit and transform every framework shares). Needs pyspark and pyarrow."""
