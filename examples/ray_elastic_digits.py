"""Elastic training on Ray: a small CNN on scikit-learn's digits data with rvod.torch's hvd.elastic, on the
nodes of a Ray cluster as they come and go (horovod.ray's ElasticRayExecutor, as in Horovod's
examples/ray/pytorch_ray_elastic.py).

    python examples/ray_elastic_digits.py                         # a local Ray instance: 2 CPUs, 2 workers
    python examples/ray_elastic_digits.py --address auto --min-workers 2 --max-workers 8   # a Ray cluster

Every node's CPUs are slots for workers: a node that joins gets workers, which start from the last commit;
a node that dies takes its workers, and the others go on from the last commit. ElasticSampler splits what
is left of each epoch over the workers of the moment. Rank 0 sends each epoch's loss to the driver with
ray_logger; the driver prints it. The model and data come from cluster_digits.py.
"""

import argparse

import ray

import cluster_digits
from rvod.ray import ElasticRayExecutor


def train_fn(epochs, batch_size, lr, seed, commit_every):
    import torch
    import torch.nn.functional as F

    import rvod.torch as hvd
    from rvod.ray import ray_logger

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    x_train, x_test, y_train, y_test = cluster_digits.digits_data(seed)
    dataset = torch.utils.data.TensorDataset(x_train, y_train)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=seed)
    model = cluster_digits.digits_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_state_reset():
        # The learning rate follows the number of workers, whose gradients are averaged.
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
            losses = []
            for state.batch, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                sampler.record_batch(state.batch, batch_size)
                if state.batch % commit_every == 0:
                    state.commit()
            mean = hvd.allreduce(torch.tensor(sum(losses) / max(len(losses), 1)), name="epoch.loss")
            ray_logger.log({"epoch": state.epoch, "workers": hvd.size(), "loss": float(mean)})
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    with torch.no_grad():
        correct = (model(x_test).argmax(dim=1) == y_test).sum()
    result = {"rank": hvd.rank(), "size": hvd.size(), "accuracy": int(correct) / len(y_test)}
    hvd.shutdown()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance (one per worker)")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    ray.cloudpickle.register_pickle_by_value(cluster_digits)  # the workers need not have this directory
    settings = ElasticRayExecutor.create_settings(min_num_proc=args.min_workers, max_num_proc=args.max_workers,
                                                  timeout_s=60)
    executor = ElasticRayExecutor(settings, cpus_per_worker=1)
    executor.start()

    def show(info):
        print(f"epoch {info['epoch']}: {info['workers']} workers, mean loss {info['loss']:.4f}", flush=True)

    try:
        results = executor.run(
            lambda: train_fn(args.epochs, args.batch_size, args.lr, args.seed, args.commit_every), callbacks=[show])
    finally:
        executor.shutdown()
    for result in results:
        print(f"rank {result['rank']}: test accuracy {result['accuracy']:.3f} ({result['size']} workers at the end)")


if __name__ == "__main__":
    main()
