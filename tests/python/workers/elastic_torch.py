"""An elastic PyTorch training job for tests/python/test_elastic.py, run by rvodrun in elastic mode.

A linear model trains on NUM_SAMPLES samples split by ElasticSampler, for EPOCHS epochs, committing every
COMMIT_EVERY batches. A per-sample counter in the committed state counts (allreduced over the ranks) how
often each sample was trained on; at the end of each epoch every rank writes it to OUT/epochs.jsonl. Every
rank writes a line to OUT/starts.jsonl each time the training function starts (after the state was
synchronised): its world, rank, size, host, epoch, batch and a checksum of its parameters. With ELASTIC_KILL set
to "round:rank:steps[,...]" the rank so placed kills itself with SIGKILL after that many steps in that world,
after writing the time to OUT/kills.jsonl; with ELASTIC_KILL_AT_INIT="round:rank[,...]" the rank so placed
kills itself as it joins that world, after every worker of it was ready but before its engine starts. With
ELASTIC_HANG="round:rank:steps:how[,...]" the rank so placed stops making progress after that many steps,
alive, after writing the time to OUT/hangs.jsonl: `sleep` blocks in the script (a long time.sleep) while the
others wait in the next collective, `stop` sends itself SIGSTOP (the whole process freezes).
Calls of state.restore() are logged to OUT/restores.jsonl. With ELASTIC_SHARDED=1 the optimizer is a sharded
SGD with momentum, and a checksum of its consolidated state is added to every start and logged by rank 0 at
every commit to OUT/commits.jsonl (once the commit returned) and OUT/precommits.jsonl (just before it, so
also for a commit that raises HostsUpdatedInterrupt). With ELASTIC_STOP_FILE set, training ends after the first
epoch that ends once that file exists (rank 0 looks; the ranks agree by allreduce), whatever ELASTIC_EPOCHS says.
With ELASTIC_COMPRESSION=int8 (or onebit) the optimizer compresses with it, and each world starts with a
compressed allreduce of a 32 x 64 matrix (each rank's from its rank) under one name; every rank logs to
OUT/probes.jsonl whether it equals the NumPy reference of a first step (no error feedback yet): a new world
must not inherit the residual the last world's step left under that name.
"""

import json
import os
import signal
import time

import numpy as np
import torch
from _compression_reference import quantized_allreduce

import rvod.common.elastic_worker
import rvod.torch as hvd

OUT = os.environ["ELASTIC_OUT"]
NUM_SAMPLES = int(os.environ.get("ELASTIC_SAMPLES", "24"))
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "3"))
BATCH = 2
COMMIT_EVERY = int(os.environ.get("ELASTIC_COMMIT_EVERY", "2"))
STEP_SECONDS = float(os.environ.get("ELASTIC_STEP_SECONDS", "0.05"))
KILLS = [tuple(int(x) for x in spec.split(":")) for spec in os.environ.get("ELASTIC_KILL", "").split(",") if spec]
STOP_FILE = os.environ.get("ELASTIC_STOP_FILE")
HANGS = {tuple(int(x) for x in spec.split(":")[:3]): spec.split(":")[3]
         for spec in os.environ.get("ELASTIC_HANG", "").split(",") if spec}
KILLS_AT_INIT = [tuple(int(x) for x in spec.split(":"))
                 for spec in os.environ.get("ELASTIC_KILL_AT_INIT", "").split(",") if spec]


def record(name, **fields):
    fields.update(time=time.time(), pid=os.getpid())
    with open(os.path.join(OUT, name), "a") as file:
        file.write(json.dumps(fields) + "\n")


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        x = torch.tensor([index / NUM_SAMPLES, 1.0, (index % 3) / 3.0, 0.5])
        return index, x, x.sum(dim=0, keepdim=True) * 0.5


join_world = rvod.common.elastic_worker.before_init


def join_world_or_die():
    join_world()
    placed = (int(os.environ["RVOD_ELASTIC_ROUND"]), int(os.environ["RVOD_RANK"]))
    if placed in KILLS_AT_INIT:
        record("kills.jsonl", round=placed[0], rank=placed[1], epoch=None, batch=None)
        os.kill(os.getpid(), signal.SIGKILL)


rvod.common.elastic_worker.before_init = join_world_or_die
torch.manual_seed(0)
torch.set_num_threads(1)
hvd.init()
dataset = Samples()
model = torch.nn.Linear(4, 1)
SHARDED = os.environ.get("ELASTIC_SHARDED") == "1"
COMPRESSION = os.environ.get("ELASTIC_COMPRESSION")
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if SHARDED else 0),
                                     named_parameters=model.named_parameters(), sharded=SHARDED,
                                     compression=getattr(hvd.Compression, COMPRESSION or "none"))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0,
                               counter=torch.zeros(NUM_SAMPLES))

restore = state.restore


def logged_restore():
    record("restores.jsonl", round=world(), rank=hvd.rank())
    restore()


state.restore = logged_restore


def checksum():
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def optimizer_checksum():
    """Of the consolidated state of the sharded optimizer (collective); None for a plain one."""
    if not SHARDED:
        return None
    whole = optimizer.consolidate_state_dict(to=None)
    return float(sum(v.double().sum() for entry in whole["state"].values() for v in entry.values()
                     if torch.is_tensor(v)))


def commit():
    """state.commit(), with the optimizer checksum logged by rank 0 before and after (sharded)."""
    committed = optimizer_checksum()
    if hvd.rank() == 0 and SHARDED:
        record("precommits.jsonl", round=world(), epoch=state.epoch, batch=state.batch, optimizer=committed)
    state.commit()
    if hvd.rank() == 0 and SHARDED:
        record("commits.jsonl", round=world(), epoch=state.epoch, batch=state.batch, optimizer=committed)


def stop_requested():
    seen = float(hvd.rank() == 0 and os.path.exists(STOP_FILE))
    return hvd.allreduce(torch.tensor([seen]), op=hvd.Max, name="stop_requested").item() > 0


def world():
    return int(os.environ.get("RVOD_ELASTIC_ROUND", "0"))


def probe_matrix(rank):
    return np.random.default_rng(rank).standard_normal((32, 64)).astype(np.float32)


def compressed_probe():
    """A world's first compressed allreduce under the name "probe", against a first step's reference."""
    got = hvd.allreduce(torch.from_numpy(probe_matrix(hvd.rank())), op=hvd.Sum, name="probe",
                        compression=getattr(hvd.Compression, COMPRESSION)).numpy()
    expected = quantized_allreduce([probe_matrix(r) for r in range(hvd.size())], COMPRESSION, "allreduce.probe")
    record("probes.jsonl", round=world(), rank=hvd.rank(), size=hvd.size(), equal=bool(np.array_equal(got, expected)),
           differs_by=float(np.abs(got - expected).max()))


@hvd.elastic.run
def train(state):
    record("starts.jsonl", round=world(), rank=hvd.rank(), size=hvd.size(), host=os.environ.get("RVOD_HOSTNAME"),
           epoch=state.epoch, batch=state.batch,
           params=checksum(), processed=len(sampler.processed_indices), counted=float(state.counter.sum()),
           optimizer=optimizer_checksum())
    if COMPRESSION:
        compressed_probe()
    steps = 0
    while state.epoch < EPOCHS:
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        for batch_idx, (_, x, y) in enumerate(loader):
            if (world(), hvd.rank(), steps) in KILLS:
                record("kills.jsonl", round=world(), rank=hvd.rank(), epoch=state.epoch, batch=state.batch)
                os.kill(os.getpid(), signal.SIGKILL)
            hang = HANGS.get((world(), hvd.rank(), steps))
            if hang is not None:
                record("hangs.jsonl", round=world(), rank=hvd.rank(), epoch=state.epoch, batch=state.batch, how=hang)
                if hang == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)
            steps += 1
            time.sleep(STEP_SECONDS)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            counts = torch.zeros(NUM_SAMPLES)
            counts[sampler.get_indices(batch_idx, BATCH)] += 1
            state.counter += hvd.allreduce(counts, op=hvd.Sum, name="sample_counts")
            sampler.record_batch(batch_idx, BATCH)
            state.batch += 1
            if state.batch % COMMIT_EVERY == 0:
                if hvd.rank() == 0:
                    record("progress.jsonl", round=world(), size=hvd.size(), epoch=state.epoch, batch=state.batch)
                commit()
        # Every rank writes it (the counts are allreduced, so they agree): a rank 0 killed or stopped between the
        # epoch's last allreduce and this line would otherwise take the record of an epoch the others finished.
        record("epochs.jsonl", epoch=state.epoch, counts=state.counter.tolist(), size=hvd.size(), rank=hvd.rank())
        state.epoch += 1
        state.batch = 0
        state.counter = torch.zeros(NUM_SAMPLES)
        sampler.set_epoch(state.epoch)
        commit()
        if STOP_FILE and stop_requested():
            break


train(state)
record("done.jsonl", round=world(), rank=hvd.rank(), size=hvd.size(), params=checksum())
