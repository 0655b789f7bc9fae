"""A torch.compile'd model's training step: rvod's DistributedOptimizer against eager rvod and DDP (gloo).

    rvodrun -np 2 python benches/torch_compile_training.py [--rounds 5] [--backend inductor]

Three contenders in the same two processes, alternating in every round (as benches/torch_training.py,
whose models and helpers this reuses): the model compiled with ``torch.compile`` and trained with
``hvd.DistributedOptimizer`` (its gradient hooks fire during the compiled backward); the same model eager
with ``hvd.DistributedOptimizer``; and the compiled model under PyTorch DDP over gloo, compiled the way
PyTorch recommends (``torch.compile(DDP(model))``, dynamo's DDPOptimizer splitting the graph at DDP's
buckets). Every contender starts from the same weights; compilation happens in untimed warm-up steps.

Every time is the slower rank's. Printed: each round, then the medians of the per-round ratios
compiled rvod / eager rvod and compiled rvod / compiled DDP, with their min-max.
"""

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import rvod.torch as hvd

_spec = importlib.util.spec_from_file_location("torch_training", Path(__file__).with_name("torch_training.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per contender and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed block (the first "
                        "round's compile the models)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--width", type=int, default=16, help="width of the synthetic-benchmark model")
    parser.add_argument("--mlp-width", type=int, default=512, help="hidden width of the MLP (4 layers)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    return parser.parse_args()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def training(args, name, build, x, y):
    torch.manual_seed(0)
    reference = build()
    models = {key: build() for key in ("compiled", "eager", "ddp")}
    for model in models.values():
        model.load_state_dict(reference.state_dict())
    compiled = torch.compile(models["compiled"], backend=args.backend)
    ddp = torch.compile(DistributedDataParallel(models["ddp"]), backend=args.backend)
    contenders = {
        "compiled rvod": (compiled, hvd.DistributedOptimizer(sgd(models["compiled"]),
                                                             named_parameters=models["compiled"].named_parameters()),
                          hvd.barrier),
        "eager rvod": (models["eager"], hvd.DistributedOptimizer(sgd(models["eager"]),
                                                                 named_parameters=models["eager"].named_parameters()),
                       hvd.barrier),
        "compiled DDP": (ddp, sgd(models["ddp"]), dist.barrier),
    }
    params = sum(p.numel() for p in reference.parameters())
    base.log(f"\n{name}: {params / 1e6:.2f} M parameters, batch {args.batch_size} per rank, {args.steps} timed steps "
             f"per contender and round, backend {args.backend}")
    start = time.perf_counter()
    for model, optimizer, barrier in contenders.values():  # compile (and warm) outside the rounds
        base.time_steps(model, optimizer, x, y, barrier, 1, 1)
    base.log(f"  compiled and warmed up in {time.perf_counter() - start:.1f} s")
    vs_eager, vs_ddp = [], []
    for round_index in range(args.rounds):
        times = {label: base.slowest(base.time_steps(model, optimizer, x, y, barrier, args.warmup, args.steps))
                 for label, (model, optimizer, barrier) in contenders.items()}
        vs_eager.append(times["compiled rvod"] / times["eager rvod"])
        vs_ddp.append(times["compiled rvod"] / times["compiled DDP"])
        base.log(f"  round {round_index}: " + ", ".join(f"{label} {t * 1e3:7.2f} ms" for label, t in times.items())
                 + f"; compiled rvod / eager rvod {vs_eager[-1]:.3f}, / compiled DDP {vs_ddp[-1]:.3f}")
    base.log("  " + base.summary("step time compiled rvod / eager rvod", vs_eager))
    base.log("  " + base.summary("step time compiled rvod / compiled DDP", vs_ddp))
    final = [next(model.parameters()).detach() for model in models.values()]
    base.log(f"  first-layer weights, max difference compiled rvod vs eager rvod {float((final[0] - final[1]).abs().max()):.2e}, "
             f"vs compiled DDP {float((final[0] - final[2]).abs().max()):.2e}")


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if hvd.size() != 2:
        raise SystemExit("run with 2 ranks: rvodrun -np 2 python benches/torch_compile_training.py")
    base.init_gloo()
    base.log(f"torch.compile'd training, rvod vs DDP(gloo): 2 ranks, 1 thread each, torch {torch.__version__}, "
             f"{os.cpu_count()} CPUs, {args.rounds} alternating rounds")
    training(args, f"SmallResNet(width={args.width}) on 32x32 images",
             *base.synthetic_benchmark_model(args.width, args.batch_size))
    training(args, f"MLP 4 x {args.mlp_width}", *base.mlp_model(args.mlp_width, args.batch_size))
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
