"""The compute job: a tf.data service for training jobs, as Horovod's ``horovod.tensorflow.data.compute_worker``.

    rvodrun -np 4 python -m rvod.tensorflow.data.compute_worker /tmp/compute.json
    rvodrun -np 4 python -m rvod.tensorflow.data.compute_worker --dispatchers 2 /tmp/compute.json
    rvodrun -np 4 python -m rvod.tensorflow.data.compute_worker --dispatcher-side training /tmp/compute.json

Rank 0 starts the compute service and writes the config file training jobs read; the config reaches the
other ranks by broadcast, so only the training jobs need to see the file. Every rank then runs
``compute_worker_fn`` until a training rank asks the service to shut down
(``config.compute_client().shutdown()``); then the job ends with exit status 0.
"""

from __future__ import annotations

import argparse

from rvod.runner.cluster_job import new_secret
from rvod.runner.compute_service import ComputeService
from rvod.tensorflow.data.compute_service import DISPATCHER_SIDES, TfDataServiceConfig, compute_worker_fn


def main(dispatchers: int, dispatchers_work_dir: str | None, dispatchers_nic: str | None, dispatcher_side: str,
         configfile: str, timeout: int):
    import rvod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if dispatchers <= 0 or size % dispatchers:
        raise ValueError(f"Number of processes ({size}) must be a multiple of number of dispatchers ({dispatchers}).")
    workers_per_dispatcher = size // dispatchers

    compute = None
    try:
        compute_config = None
        if rank == 0:
            key = new_secret()
            compute = ComputeService(dispatchers, workers_per_dispatcher, key=key,
                                     nics=[dispatchers_nic] if dispatchers_nic else None)
            compute_config = TfDataServiceConfig(dispatchers=dispatchers, dispatchers_work_dir=dispatchers_work_dir,
                                                 dispatchers_nic=dispatchers_nic,
                                                 workers_per_dispatcher=workers_per_dispatcher,
                                                 dispatcher_side=dispatcher_side, addresses=compute.addresses(),
                                                 key=key, timeout=timeout)
            compute_config.write(configfile)
            print(f"compute service of {dispatchers} dispatcher(s) ({dispatcher_side} side) and {size} worker(s) "
                  f"at {compute.addresses()}; config in {configfile}", flush=True)
        compute_config = hvd.broadcast_object(compute_config, root_rank=0, name="TfDataServiceConfig")
        compute_worker_fn(compute_config)
        # The service outlives every rank's wait for the shutdown request.
        hvd.barrier()
    finally:
        if compute is not None:
            compute.shutdown()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m rvod.tensorflow.data.compute_worker",
                                     description="Runs tf.data service dispatchers and workers for training jobs.")
    parser.add_argument("configfile", help="The path to store the compute service config file.")
    parser.add_argument("--dispatchers", default=1, type=int, help="The number of dispatchers to support.")
    parser.add_argument("--dispatchers-work-dir", default=None,
                        help="The path to dispatchers working directories. Setting this enables fault tolerance mode.")
    parser.add_argument("--dispatchers-nic", default=None,
                        help="The network interface (NIC) to reach the dispatchers (default: loopback, one host).")
    parser.add_argument("--dispatcher-side", default="compute", choices=DISPATCHER_SIDES,
                        help="Where do the dispatchers run? On 'compute' side or 'training' side.")
    parser.add_argument("--timeout", default=60, type=int, help="Timeout to setup worker and connect everything.")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    main(args.dispatchers, args.dispatchers_work_dir, args.dispatchers_nic, args.dispatcher_side, args.configfile,
         args.timeout)
