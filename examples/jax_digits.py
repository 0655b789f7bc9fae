"""Data-parallel training of a small MLP on scikit-learn's digits data with rvod.jax and optax.

Each rank trains on its own shard of every global batch, with the learning rate of one rank: the
DistributedOptimizer averages the gradients across ranks inside the jitted training step (which donates the
parameters and optimizer state it replaces), so N ranks take the steps one process would take on the
global batch. Rank 0's initial parameters are broadcast, and the test accuracy is summed over every rank's
shard of the test set. Rank 0 prints the loss per epoch and ends with the test accuracy. Run it with:

    rvodrun -np 2 python examples/jax_digits.py
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rvod.jax as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def init_params(sizes, seed):
    rng = np.random.default_rng(seed)
    return [{"w": jnp.asarray(rng.normal(size=(fan_in, fan_out)) / np.sqrt(fan_in), jnp.float32),
             "b": jnp.zeros(fan_out, jnp.float32)} for fan_in, fan_out in zip(sizes[:-1], sizes[1:])]


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32), test_size=0.25,
        random_state=args.seed)

    # Different on purpose on every rank: the broadcast aligns them.
    params = init_params([64, args.hidden, 10], args.seed + rank)
    params = hvd.broadcast_parameters(params, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optax.sgd(args.lr, momentum=args.momentum))
    opt_state = optimizer.init(params)

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, hvd.allreduce(loss, name="train.loss")

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    @jax.jit
    def correct(params, x, y):
        return jnp.sum(jnp.argmax(predict(params, x), axis=1) == y)

    def test_accuracy(params):
        shard = slice(rank, None, size)  # every rank counts its shard; the counts are summed
        counts = jnp.asarray([int(correct(params, x_test[shard], y_test[shard])), len(y_test[shard])])
        total = hvd.allreduce(counts, op=hvd.Sum, name="test.counts")
        return int(total[0]) / int(total[1])

    global_batch = args.batch_size * size
    steps = len(y_train) // global_batch
    order = np.random.default_rng(args.seed)  # the same permutation on every rank
    start = time.perf_counter()
    for epoch in range(args.epochs):
        permutation = order.permutation(len(y_train))
        losses = []
        for step in range(steps):
            batch = permutation[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * args.batch_size:(rank + 1) * args.batch_size]
            params, opt_state, loss = train_step(params, opt_state, x_train[mine], y_train[mine])
            losses.append(loss)
        accuracy = test_accuracy(params)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {float(np.mean(losses)):.4f} (mean over ranks), "
                  f"test accuracy {accuracy:.4f}", flush=True)

    # Data-parallel training keeps every rank's parameters identical.
    for index, leaf in enumerate(jax.tree_util.tree_leaves(params)):
        if not np.array_equal(np.asarray(hvd.broadcast(leaf, root_rank=0, name=f"check.{index}")), np.asarray(leaf)):
            raise SystemExit(f"rank {rank}: parameter {index} differs from rank 0's")
    accuracy = test_accuracy(params)
    if rank == 0:
        print(f"trained on {size} ranks in {time.perf_counter() - start:.1f} s; test accuracy {accuracy:.4f}",
              flush=True)
    hvd.shutdown()
    if accuracy <= 0.9:
        raise SystemExit(f"test accuracy {accuracy:.3f} is not above 0.9")


if __name__ == "__main__":
    main()
