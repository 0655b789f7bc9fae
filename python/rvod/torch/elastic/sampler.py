"""``ElasticSampler``: the samples of an epoch split over the ranks of the current world, skipping the
samples a committed state has already processed.

Invariant: every rank records the same processed samples (``record_batch`` records the whole batch of
every rank, which each rank can work out), so the commit of any surviving rank knows what a rank that died
had processed, and no sample is repeated or skipped when the world changes. To give every rank the same
number of samples, the last ones are padded with repeats, as ``DistributedSampler`` does; padding is
never recorded as processed.
"""

import math
import random

import torch

from rvod.torch.mpi_ops import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch ``epoch``: every sample is to be processed again."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def reset(self):
        """Re-splits the unprocessed samples over the ranks of the current world."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _padded(self):
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:
            padded += self.remaining_indices[: self.total_size - len(padded)]
        return padded

    def __iter__(self):
        return iter(self._padded()[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples

    def get_indices(self, batch_idx, batch_size, rank=None):
        """The samples (padding left out) of batch ``batch_idx`` of ``batch_size`` on ``rank`` (default: this
        rank), counted from the last reset."""
        rank = self.rank if rank is None else rank
        start, end = batch_idx * batch_size, min((batch_idx + 1) * batch_size, self.num_samples)
        positions = (local * self.num_replicas + rank for local in range(start, end))
        return [self.remaining_indices[p] for p in positions if p < len(self.remaining_indices)]

    def record_batch(self, batch_idx, batch_size):
        """Marks batch ``batch_idx`` of every rank as processed (call it once the batch's step is done)."""
        for r in range(self.num_replicas):
            self.record_indices(self.get_indices(batch_idx, batch_size, r))

    def record_indices(self, indices):
        self.processed_indices.update(indices)

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()
