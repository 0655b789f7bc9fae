"""The synthetic benchmark of torch_synthetic_benchmark.py as an elastic job, written the way Horovod's
pytorch_synthetic_benchmark_elastic.py is: the model, optimizer and results live in a TorchState, every
batch commits (--num-batches-per-commit), and a reset (a worker died, or hosts came or went) goes on from the last commit with the
learning rate scaled to the new number of ranks. Run it with:

    rvodrun --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python examples/torch_synthetic_benchmark_elastic.py
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch_synthetic_benchmark import SmallResNet, synthetic_batch
from torch_synthetic_benchmark import parse_args as benchmark_args

import rvod.torch as hvd


def parse_args():
    """torch_synthetic_benchmark.py's options, and how many batches go between commits."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--num-batches-per-commit", type=int, default=1)
    elastic_args, rest = own.parse_known_args()
    args = benchmark_args(rest)
    args.num_batches_per_commit = elastic_args.num_batches_per_commit
    return args


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # the same initial model on every rank; the first sync makes sure of it
    hvd.init()
    model = SmallResNet(args.width)
    lr = 0.01

    def lr_scaler():
        return 1 if args.use_adasum else hvd.size()  # Adasum needs no larger learning rate

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * lr_scaler()),
                                         named_parameters=model.named_parameters(), compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    images, labels = synthetic_batch(args.batch_size, args.image_size, seed=hvd.rank())

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    def benchmark_step(state):
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        state.batch += 1
        if state.batch == args.num_batches_per_commit:
            state.batch = 0
            state.commit()

    @hvd.elastic.run
    def run_benchmark(state):
        log(f"Training on {hvd.size()} ranks")
        if not state.warm:
            log("Running warmup...")
            timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
            state.warm = True
            state.commit()
        if state.iter == 0:
            log("Running benchmark...")
        for i in range(state.iter, args.num_iters):
            seconds = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
            img_sec = args.batch_size * args.num_batches_per_iter / seconds
            log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
            state.img_secs.append(img_sec)
            state.iter = i + 1
            state.commit()

    def on_state_reset():
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_scaler()

    state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
    state.register_reset_callbacks([on_state_reset])
    run_benchmark(state)
    mean, conf = np.mean(state.img_secs), 1.96 * np.std(state.img_secs)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    log(f"Iterations recorded: {len(state.img_secs)}")


if __name__ == "__main__":
    main()
