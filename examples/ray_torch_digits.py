"""Train a small CNN on scikit-learn's digits data with rvod.torch on Ray workers (horovod.ray's API).

    python examples/ray_torch_digits.py                        # a local Ray instance, 2 workers
    python examples/ray_torch_digits.py --address auto -np 4   # an existing Ray cluster

Each worker is a Ray actor placed by a placement group; the training function is in cluster_digits.py.
"""

import argparse

import ray

import cluster_digits
from rvod.ray import RayExecutor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("-np", "--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False)
    ray.cloudpickle.register_pickle_by_value(cluster_digits)  # the workers need not have this directory
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers)
    executor.start()
    try:
        results = executor.run(cluster_digits.train_digits, kwargs={"epochs": args.epochs})
    finally:
        executor.shutdown()
    cluster_digits.report(results)


if __name__ == "__main__":
    main()
