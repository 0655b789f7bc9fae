"""Data-parallel training of a small Gluon CNN on scikit-learn's digits data with rvod.mxnet.

A Horovod MXNet script with one changed import: each rank trains on its own shard of the data, the
learning rate is scaled by the number of ranks, rank 0's initial weights are broadcast (the parameters
are initialized lazily at the first forward pass, and broadcast right then), DistributedTrainer sums the
gradients across ranks and averages them, and metrics are averaged with allreduce. Rank 0 reports each
epoch and ends with the test accuracy. Needs the MXNet environment (scripts/setup-mxnet-env.sh):

    .venv-mxnet/bin/rvodrun -np 2 .venv-mxnet/bin/python examples/mxnet_digits.py
"""

import argparse
import hashlib
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rvod.mxnet as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of a single rank (times the ranks)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                        help="divide gradients by this before the sum and multiply after (Horovod's option)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as float16")
    parser.add_argument("--seed", type=int, default=42, help="data split and initial weights")
    return parser.parse_args()


def digits_net():
    """Two 3x3 convolutions, a pooling layer and two dense layers for 8x8 images. No input sizes are
    given: Gluon infers them at the first forward pass (deferred initialization)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
            gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(),
            gluon.nn.Dense(64, activation="relu"),
            gluon.nn.Dropout(0.25),
            gluon.nn.Dense(10))
    return net


def datasets(seed):
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, np.newaxis]
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target.astype(np.float32), test_size=0.25,
                                                        random_state=seed)
    return gluon.data.ArrayDataset(x_train, y_train), gluon.data.ArrayDataset(x_test, y_test)


def shard(dataset, rank, size, equal=False):
    """This rank's share of ``dataset``: every size-th sample, starting at ``rank``. ``equal`` leaves out the
    last few samples so that every rank gets as many (and so takes as many training steps)."""
    end = len(dataset) - len(dataset) % size if equal else len(dataset)
    return gluon.data.SimpleDataset([dataset[i] for i in range(rank, end, size)])


def metric_average(value, name):
    """The mean of ``value`` over all ranks."""
    return hvd.allreduce(mx.nd.array([value], dtype=np.float64), name=name).asscalar()


def evaluate(net, loader):
    """Accuracy over the whole test set: every rank counts its shard, the counts are summed."""
    correct = total = 0
    for x, y in loader:
        correct += int((net(x).argmax(axis=1) == y).sum().asscalar())
        total += len(y)
    counts = hvd.allreduce(mx.nd.array([correct, total], dtype=np.int64), name="test.counts", op=hvd.Sum)
    return int(counts[0].asscalar()) / int(counts[1].asscalar())


def main():
    args = parse_args()
    hvd.init()
    mx.random.seed(args.seed + hvd.rank())  # different on purpose: the broadcast below aligns the ranks
    np.random.seed(args.seed + hvd.rank())

    train_set, test_set = datasets(args.seed)
    train_loader = gluon.data.DataLoader(shard(train_set, hvd.rank(), hvd.size(), equal=True), batch_size=args.batch_size,
                                         shuffle=True, last_batch="keep")
    test_loader = gluon.data.DataLoader(shard(test_set, hvd.rank(), hvd.size()), batch_size=256)

    net = digits_net()
    net.hybridize()
    net.initialize(mx.init.Xavier())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # deferred: runs when the first forward pass sets the shapes
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * hvd.size(),
                                                     "momentum": args.momentum}, compression=compression,
                                     gradient_predivide_factor=args.gradient_predivide_factor)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    start = time.perf_counter()
    for epoch in range(args.epochs):
        loss_sum = mx.nd.zeros((1,))
        for x, y in train_loader:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])  # sums the gradients over the ranks, then steps with their mean
            loss_sum += loss.mean()
        mean_loss = metric_average(loss_sum.asscalar() / len(train_loader), "train.loss")
        accuracy = evaluate(net, test_loader)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}: loss {mean_loss:.4f} (mean over ranks), "
                  f"test accuracy {accuracy:.4f}", flush=True)

    # Data-parallel training keeps every rank's weights identical: all ranks must hold the same digest.
    weights = b"".join(param.data().asnumpy().tobytes() for param in params.values())
    digests = hvd.allgather_object(hashlib.sha256(weights).hexdigest(), name="weights.digest")
    accuracy = evaluate(net, test_loader)
    rank, size, elapsed = hvd.rank(), hvd.size(), time.perf_counter() - start
    hvd.shutdown()
    if len(set(digests)) != 1:
        raise SystemExit(f"rank {rank}: the ranks' weights differ")
    if rank == 0:
        print(f"trained on {size} ranks in {elapsed:.1f} s; test accuracy {accuracy:.4f}", flush=True)
    if accuracy <= 0.9:
        raise SystemExit(f"test accuracy {accuracy:.3f} is not above 0.9")


if __name__ == "__main__":
    main()
