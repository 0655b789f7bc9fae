"""Data-parallel training of a small CNN on scikit-learn's digits data with rvod.torch.

A Horovod PyTorch script with one changed import: each rank trains on its own shard of the data
(DistributedSampler), the learning rate is scaled by the number of ranks, rank 0's initial weights and
optimizer state are broadcast, DistributedOptimizer averages gradients while backward runs, and metrics
are averaged with allreduce. Rank 0 shows a progress bar and ends with the test accuracy. Run it with:

    rvodrun -np 2 python examples/torch_digits.py
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import rvod.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--compression", choices=["none", "fp16", "int8", "onebit", "powersgd"], default="none",
                        help="how gradients travel between hosts (docs/compression.md); powersgd at rank 4")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, a pooling layer and two fully connected layers for 8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), 0.25, self.training)
        return self.fc2(x)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=0.25, random_state=seed)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def progress_bar(done, total, text, end_of_epoch=False):
    """A bar over the whole run: redrawn in place on a terminal after every step; elsewhere (e.g. under
    rvodrun, whose output is line by line) drawn once per epoch."""
    width = 30
    filled = width * done // total
    line = f"[{'#' * filled}{'.' * (width - filled)}] {100 * done // total:3d}% {text}"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if end_of_epoch else "", flush=True)
    elif end_of_epoch:
        print(line, flush=True)


def metric_average(value, name):
    """The mean of ``value`` over all ranks."""
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def evaluate(model, loader):
    """Accuracy over the whole test set: every rank counts its shard, the counts are summed."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(dim=1) == y).sum())
            total += len(y)
    counts = hvd.allreduce(torch.tensor([correct, total], dtype=torch.int64), name="test.counts", op=hvd.Sum)
    return int(counts[0]) / int(counts[1])


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)  # one core per rank
    torch.manual_seed(args.seed + hvd.rank())  # different on purpose: the broadcast below aligns the ranks

    train_set, test_set = datasets(args.seed)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "int8": hvd.Compression.int8,
                   "onebit": hvd.Compression.onebit, "powersgd": hvd.Compression.powersgd(rank=4)}[args.compression]
    if args.fp16_allreduce:
        compression = hvd.Compression.fp16
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    start = time.perf_counter()
    total_steps = args.epochs * len(train_loader)
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        loss_sum = 0.0
        for step, (x, y) in enumerate(train_loader, 1):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            if hvd.rank() == 0:
                progress_bar(epoch * len(train_loader) + step, total_steps,
                             f"epoch {epoch + 1}/{args.epochs} loss {loss_sum / step:.4f}")
        mean_loss = metric_average(loss_sum / len(train_loader), "train.loss")
        accuracy = evaluate(model, test_loader)
        if hvd.rank() == 0:
            progress_bar((epoch + 1) * len(train_loader), total_steps,
                         f"epoch {epoch + 1}/{args.epochs} loss {mean_loss:.4f} (mean over ranks), "
                         f"test accuracy {accuracy:.4f}", end_of_epoch=True)

    # Data-parallel training keeps every rank's weights identical.
    for name, tensor in model.state_dict().items():
        if not torch.equal(hvd.broadcast(tensor, root_rank=0, name=f"check.{name}"), tensor):
            raise SystemExit(f"rank {hvd.rank()}: {name} differs from rank 0's")
    accuracy = evaluate(model, test_loader)
    if hvd.rank() == 0:
        print(f"trained on {hvd.size()} ranks in {time.perf_counter() - start:.1f} s; "
              f"test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()
    if accuracy <= 0.9:
        raise SystemExit(f"test accuracy {accuracy:.3f} is not above 0.9")


if __name__ == "__main__":
    main()
