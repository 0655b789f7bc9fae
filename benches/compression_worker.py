"""One rank of the compression benchmark (see compression.py): holds an rvod engine and a gloo process group
at once and, round after round, trains each model from the same initial weights with each contender in
turn, on the same shards of scikit-learn's digits data in the same order (each round from its own seed: its
own initial weights and order, the same for every contender of the round).

    python compression_worker.py '{"models": [...], "contenders": [...], "rounds": k, "epochs": {...}, ...}'

Per model, contender and round, rank 0 prints one JSON line: the slower rank's seconds per step (timed after
`warmup` untimed steps and a barrier, to the end of training), the bytes both ways on its host's veth per
step over the same steps (its /sys/class/net counters, which `ip netns exec` shows for the namespace; the
veth is the one GLOO_SOCKET_IFNAME names) and the test accuracy after the fixed number of epochs.
"""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import rvod.torch as hvd

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_digits.py"
SEED = 42


def digits_example():
    spec = importlib.util.spec_from_file_location("torch_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp(width):
    """The 4-layer MLP of benches/torch_training.py, its input the 64 pixels of a digit."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def link_bytes():
    """Bytes sent plus received so far on this host's end of the shaped link."""
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return sum(int((stats / f"{way}_bytes").read_text()) for way in ("tx", "rx"))


def rvod_compression(contender):
    kind = contender.removeprefix("rvod-")
    return hvd.Compression.powersgd(rank=int(kind[len("powersgd"):])) if kind.startswith("powersgd") \
        else getattr(hvd.Compression, kind)


def wrap(contender, model, optimizer, tag, rank):
    """(module to call, optimizer, barrier) for `contender`; rvod's tensor names carry `tag`, so that no
    contender or round inherits another's error feedback."""
    if contender == "local":  # no communication: the step's computation alone (each rank its own model)
        return model, optimizer, hvd.barrier
    if contender.startswith("rvod-"):
        names = [(f"{tag}.{name}", p) for name, p in model.named_parameters()]
        return model, hvd.DistributedOptimizer(optimizer, named_parameters=names,
                                               compression=rvod_compression(contender)), hvd.barrier
    if not contender.startswith("ddp-powersgd"):
        return DistributedDataParallel(model), optimizer, dist.barrier
    # One bucket: the hook chains each bucket's allreduces in future callbacks, whose order across buckets
    # differs between ranks, and gloo then pairs different buckets' messages (a size mismatch that aborts).
    ddp = DistributedDataParallel(model, bucket_cap_mb=256)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, optimizer, dist.barrier


def accuracy(model, test_set):
    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        return float((model(x).argmax(dim=1) == y).float().mean())


def train(plan, build, contender, tag, train_set, test_set, seed):
    torch.manual_seed(seed)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=plan["lr"] * hvd.size(), momentum=0.9)
    module, optimizer, barrier = wrap(contender, model, optimizer, tag, plan["powersgd_rank"])
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    loader = DataLoader(train_set, batch_size=plan["batch_size"], sampler=sampler)
    step, start, bytes_before, cpu_before = 0, None, 0, 0.0
    for epoch in range(plan["epochs"]):
        module.train()
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == plan["warmup"]:
                barrier()
                start, bytes_before, cpu_before = time.perf_counter(), link_bytes(), time.process_time()
            optimizer.zero_grad()
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
            step += 1
    timed = step - plan["warmup"]
    seconds = (time.perf_counter() - start) / timed
    # This process's CPU time, all its threads (the engine's included), over the timed steps.
    cpu = (time.process_time() - cpu_before) / timed
    wire = (link_bytes() - bytes_before) / timed
    barrier()
    return seconds, cpu, wire, accuracy(model, test_set)


def main():
    plan = json.loads(sys.argv[1])
    os.environ.setdefault("RVOD_CACHE_CAPACITY", "4096")
    hvd.init()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    example = digits_example()
    train_set, test_set = example.datasets(SEED)
    builds = {"mlp": lambda: mlp(plan["mlp_width"]), "digits-cnn": example.DigitsNet}
    for round_index in range(plan["rounds"]):
        for model_name in plan["models"]:
            for contender in plan["contenders"]:
                run = dict(plan, epochs=plan["epochs"][model_name])
                seconds, cpu, wire, acc = train(run, builds[model_name], contender,
                                           f"{model_name}.{contender}.r{round_index}", train_set, test_set,
                                           SEED + round_index)
                seconds = max(hvd.allgather_object(seconds, name="bench.seconds"))
                cpu = sum(hvd.allgather_object(cpu, name="bench.cpu"))
                if hvd.rank() == 0:
                    print(json.dumps({"round": round_index, "model": model_name, "contender": contender,
                                      "seconds_per_step": seconds, "cpu_seconds_per_step": cpu,
                                      "cores": len(os.sched_getaffinity(0)), "wire_bytes_per_step": wire, "accuracy": acc}),
                          flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
