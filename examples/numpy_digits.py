"""Data-parallel training of a small two-layer network on scikit-learn's digits data with rvod.numpy.

Every rank trains on its own shard of the training set; gradients are averaged across ranks with one
grouped allreduce per step, the initial weights come from rank 0, and the learning rate is scaled by the
number of ranks, as in Horovod's examples. Run it with:

    rvodrun -np 2 python examples/numpy_digits.py
"""

import argparse
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rvod.numpy as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate for one rank")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def init_params(rng, n_in, n_hidden, n_out):
    return {
        "w1": rng.normal(0.0, np.sqrt(2.0 / n_in), (n_in, n_hidden)).astype(np.float32),
        "b1": np.zeros(n_hidden, np.float32),
        "w2": rng.normal(0.0, np.sqrt(1.0 / n_hidden), (n_hidden, n_out)).astype(np.float32),
        "b2": np.zeros(n_out, np.float32),
    }


def forward(params, x):
    hidden = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    logits = hidden @ params["w2"] + params["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return hidden, probs


def gradients(params, x, y):
    """Cross-entropy loss and its gradients for one batch."""
    hidden, probs = forward(params, x)
    n = x.shape[0]
    loss = -np.log(probs[np.arange(n), y] + 1e-12).mean()
    d_logits = probs
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    d_hidden = (d_logits @ params["w2"].T) * (hidden > 0)
    grads = {
        "w2": hidden.T @ d_logits,
        "b2": d_logits.sum(axis=0),
        "w1": x.T @ d_hidden,
        "b1": d_hidden.sum(axis=0),
    }
    return float(loss), {k: v.astype(np.float32) for k, v in grads.items()}


def accuracy(params, x, y):
    return float((forward(params, x)[1].argmax(axis=1) == y).mean())


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=args.seed)
    # Each rank takes every size-th sample, like torch's DistributedSampler.
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    params = init_params(np.random.default_rng(args.seed + rank), x.shape[1], args.hidden, 10)
    # Start every rank from rank 0's weights.
    for name in sorted(params):
        hvd.broadcast_(params[name], root_rank=0, name=f"param.{name}")

    lr = args.lr * size
    rng = np.random.default_rng(args.seed + 1000 + rank)
    steps = len(x_shard) // args.batch_size
    names = sorted(params)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        losses = []
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            loss, grads = gradients(params, x_shard[idx], y_shard[idx])
            averaged = hvd.grouped_allreduce([grads[n] for n in names], name="grads", op=hvd.Average)
            for name, grad in zip(names, averaged):
                params[name] -= lr * grad
            losses.append(loss)
        mean_loss = hvd.allreduce(np.array(np.mean(losses), np.float32), name="loss", op=hvd.Average)
        if rank == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print(f"epoch {epoch + 1:3d}  loss {float(mean_loss):.4f}  test accuracy {accuracy(params, x_test, y_test):.4f}",
                  flush=True)

    # Every rank must hold identical weights after data-parallel training.
    for name in names:
        reference = hvd.broadcast(params[name], root_rank=0, name=f"check.{name}")
        if not np.array_equal(reference, params[name]):
            raise SystemExit(f"rank {rank}: parameter {name} differs from rank 0's")
    final = accuracy(params, x_test, y_test)
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(f"trained on {size} ranks in {elapsed:.1f} s; final test accuracy {final:.4f}", flush=True)
    hvd.shutdown()
    if final < 0.9:
        raise SystemExit(f"test accuracy {final:.3f} is below 0.9")


if __name__ == "__main__":
    main()
