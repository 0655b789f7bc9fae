"""A training job of 2 ranks (rvodrun) on a running compute job: reads the config file the compute job wrote,
takes Dataset.range(ELEMENTS).batch(BATCH) from the tf.data service once in a job of its own per rank and
once in one job the ranks share, and prints one line, ``result {json}``, that the test checks (nothing is
asserted here). Then it reads an endless dataset from the service, printing ``streaming`` once, until the
test kills the compute job and the watchdog ends the ranks.

    python tf_data_service.py CONFIGFILE ELEMENTS BATCH
"""

import dataclasses
import json
import socket
import sys
import tempfile
import time

import tensorflow as tf

import rvod.tensorflow as hvd
from rvod.tensorflow.data.compute_service import ComputeServiceError, TfDataServiceConfig

configfile, elements, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hvd.init()
rank, size = hvd.rank(), hvd.size()
result = {"rank": rank, "size": size}

config = TfDataServiceConfig.read(configfile, wait_for_file_creation=True, timeout=60)
with tempfile.TemporaryDirectory() as folder:
    config.write(f"{folder}/copy.json")
    result["round_trip"] = (TfDataServiceConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
                            and TfDataServiceConfig.read(f"{folder}/copy.json") == config)
    start = time.monotonic()
    try:
        TfDataServiceConfig.read(f"{folder}/never-written.json", wait_for_file_creation=True, timeout=0.5)
    except ComputeServiceError as error:
        result["no_config"] = [type(error).__name__, str(error), round(time.monotonic() - start, 2)]
result["config"] = {key: value for key, value in config.to_dict().items() if key != "key"}


def batches(dataset):
    return [b.tolist() for b in dataset.as_numpy_iterator()]


# A config whose service is not there (nothing listens at its port).
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    nowhere = probe.getsockname()[1]
start = time.monotonic()
try:
    tf.data.Dataset.range(4).send_to_data_service(
        dataclasses.replace(config, addresses={"lo": [("127.0.0.1", nowhere)]}, timeout=1), rank, size)
except ComputeServiceError as error:
    result["dead"] = [type(error).__name__, str(error), round(time.monotonic() - start, 2)]

own = tf.data.Dataset.range(elements).batch(batch).send_to_data_service(config, rank, size)
result["own"] = batches(own)
hvd.barrier()  # the shared job starts when both ranks are done with their own
shared = tf.data.Dataset.range(elements).map(lambda x: x * 10).batch(batch)
result["shared"] = batches(shared.send_to_data_service(config, rank, size, reuse_dataset=True))
hvd.barrier()

print("result " + json.dumps(result), flush=True)

for i, _ in enumerate(tf.data.Dataset.range(10**9).send_to_data_service(config, rank, size)):
    if i == 0:
        print("streaming", flush=True)
    time.sleep(0.05)
