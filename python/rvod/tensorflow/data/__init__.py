"""Horovod's ``horovod.tensorflow.data``: a tf.data service beside the training job.

- ``compute_service``: ``TfDataServiceConfig`` (the config file a compute job writes and training jobs read),
  ``tf_data_service`` (the dispatcher address for a training rank), ``send_to_data_service`` (also
  ``tf.data.Dataset.send_to_data_service``) and ``compute_worker_fn`` (one compute rank's dispatcher and worker);
- ``compute_worker``: the compute job, ``rvodrun -np N python -m rvod.tensorflow.data.compute_worker CONFIGFILE``.

The rendezvous between the two jobs is ``rvod.runner.compute_service``. See docs/tf-data-service.md.
"""
