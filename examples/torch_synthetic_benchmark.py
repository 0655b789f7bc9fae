"""Training throughput on synthetic data, measured the way Horovod's pytorch_synthetic_benchmark.py does.

Every rank trains a model on one fixed random batch: ``--num-warmup-batches`` warm-up batches, then
``--num-iters`` timed iterations of ``--num-batches-per-iter`` batches each. Rank 0 prints images per second
per rank for each iteration, their mean +- 1.96 standard deviations, and the total over all ranks. Run it
with:

    rvodrun -np 2 python examples/torch_synthetic_benchmark.py [--use-adasum] [--fp16-allreduce]

The command line is Horovod's (``--model``, ``--batch-size``, ``--num-warmup-batches``,
``--num-batches-per-iter``, ``--num-iters``, ``--fp16-allreduce``, ``--use-adasum``, ``--no-cuda``, with its
defaults) and so are the calls: plain SGD, batch norm layers that are ``hvd.SyncBatchNorm``, Horovod's
learning-rate scaling. Two differences: the default ``--model`` is ``small_resnet``, a small residual CNN
defined below, so that neither torchvision nor a GPU is needed (``--model resnet50`` or any other
torchvision model name works where torchvision is installed), on ``--image-size`` images (32 x 32, Horovod's
are 224 x 224). As in Horovod's, the model trains on GPU ``local_rank() % device_count`` where CUDA is
available, unless ``--no-cuda``; ranks that share a GPU reduce through host memory. ``--width`` and
``--threads`` are rvod's.

``--use-adasum`` combines the parameter updates with Adasum instead of averaging gradients; as in
Horovod, the learning rate is then not scaled by the number of ranks, except by the ranks per host where
the job spans several hosts with the same number of ranks each (Adasum is then taken across hosts of each
host's average, as in Horovod's GPU build, which scales by ``local_size()`` there).
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import rvod.torch as hvd


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--model", default="small_resnet",
                        help="small_resnet (defined here) or the name of a torchvision model")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU even where CUDA is available")
    parser.add_argument("--use-adasum", action="store_true", help="combine updates with Adasum")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32, help="channels of small_resnet's first stage")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return parser.parse_args(argv)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (strided 1x1 when the shape changes)."""

    def __init__(self, channels_in, channels_out, stride, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(channels_out)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                          norm_layer(channels_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A stem, three stages of two residual blocks (width, 2 x width, 4 x width channels) and a classifier;
    ``norm_layer`` makes the batch norm layers (torchvision's argument)."""

    def __init__(self, width=32, num_classes=100, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), norm_layer(width), nn.ReLU())
        stages, channels = [], width
        for i, out in enumerate((width, 2 * width, 4 * width)):
            stride = 1 if i == 0 else 2
            stages += [ResidualBlock(channels, out, stride, norm_layer), ResidualBlock(out, out, 1, norm_layer)]
            channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_model(args):
    """The model ``--model`` names, its batch norm layers synchronised across ranks as in Horovod's script."""
    if args.model == "small_resnet":
        return SmallResNet(args.width, norm_layer=hvd.SyncBatchNorm)
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {args.model} needs torchvision (pip install torchvision); "
                         "--model small_resnet does not") from None
    if not callable(getattr(models, args.model, None)):
        raise SystemExit(f"--model {args.model}: torchvision.models has no such model")
    return getattr(models, args.model)(norm_layer=hvd.SyncBatchNorm)


def synthetic_batch(batch_size, image_size, num_classes=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return images, labels


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = not args.no_cuda and torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = build_model(args).to(device)
    lr_scaler = hvd.size()
    if args.use_adasum:
        # Adasum needs no larger learning rate, but the hierarchical one averages inside each host.
        hierarchical = hvd.cross_size() > 1 and hvd.local_size() > 1 and hvd.is_homogeneous()
        lr_scaler = hvd.local_size() if hierarchical else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    images, labels = synthetic_batch(args.batch_size, args.image_size, seed=hvd.rank())
    images, labels = images.to(device), labels.to(device)

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)  # the step's GPU work is inside the time

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    params = sum(p.numel() for p in model.parameters())
    name = f"small_resnet(width={args.width})" if args.model == "small_resnet" else args.model
    log(f"Model: {name}, {params / 1e6:.2f} M parameters; batch size {args.batch_size}, "
        f"images {args.image_size}x{args.image_size}; ranks: {hvd.size()} on {device.type}; "
        f"{'Adasum' if args.use_adasum else 'Average'}, lr {0.01 * lr_scaler:g}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
