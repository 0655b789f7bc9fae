"""The training function that examples/ray_torch_digits.py and examples/spark_torch_digits.py run on every
rank: a small CNN on scikit-learn's digits data (no download) with rvod.torch, Horovod style. Each rank
trains on its shard, DistributedOptimizer averages gradients, and the function returns this rank's test
accuracy (over the whole test set) and its training time. ``digits_data`` and ``digits_model`` are the data
and the model (examples/ray_elastic_digits.py trains them elastically)."""

import time


def digits_data(seed=42):
    """(x_train, x_test, y_train, y_test): the digits as 1x8x8 float images in [0, 1] and int64 labels."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    return train_test_split(images, labels, test_size=0.25, random_state=seed)


def digits_model():
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def train_digits(epochs=8, batch_size=32, lr=0.02, seed=42):
    import torch
    import torch.nn.functional as F

    import rvod.torch as hvd

    hvd.init()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        x_train, x_test, y_train, y_test = digits_data(seed)
        mine = slice(hvd.rank(), None, hvd.size())  # this rank's shard
        x_train, y_train, x_test, y_test = x_train[mine], y_train[mine], x_test[mine], y_test[mine]
        model = digits_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        start = time.perf_counter()
        for epoch in range(epochs):
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed + epoch))
            for first in range(0, len(order), batch_size):
                batch = order[first:first + batch_size]
                optimizer.zero_grad()
                F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
                optimizer.step()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            correct = (model(x_test).argmax(dim=1) == y_test).sum()
        counts = hvd.allreduce(torch.tensor([int(correct), len(y_test)]), op=hvd.Sum, name="test.counts")
        return {"rank": hvd.rank(), "accuracy": int(counts[0]) / int(counts[1]), "train_seconds": seconds}
    finally:
        hvd.shutdown()


def report(results):
    """One line per rank of what ``train_digits`` returned."""
    for result in results:
        print(f"rank {result['rank']}: test accuracy {result['accuracy']:.3f}, "
              f"training {result['train_seconds']:.1f} s")
