"""The order of the samples and the seeds of their augmentation: pure functions of (seed, epoch,
index), so a resumed or rescaled run sees exactly the same samples, augmented the same way."""

from __future__ import annotations

import hashlib
import random
from typing import Callable

import numpy as np
import torch

from .. import batching

# The index a process gets for an optimizer step in which it takes no sample (a short last batch
# shared by fewer processes): it still yields a (empty) batch, so every process runs every step.
NO_SAMPLE = -1


def mix_seed(*parts) -> int:
    """A 63-bit seed from any tuple of values (stable across processes and Python runs)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


class StepBatchSampler:
    """Yields this process's share of each optimizer batch, as (index, epoch, step_samples) keys, where
    step_samples is the size of the whole optimizer batch across processes (and, with `size_at`,
    the step's image size as a fourth part).

    Written by hand because the order must not depend on the process count (the same global batch at
    1 or 8 processes) and must restart at any step; samplers from torch/Accelerate shard per process
    before batching, so neither holds. A process whose share of a step is empty yields one
    `NO_SAMPLE` key, which the dataset and `collate` turn into an empty batch for that step.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, num_processes: int, seed: int,
                 size_at: Callable[[int], int] | None = None):
        self.n, self.global_batch, self.seed = num_samples, global_batch, seed
        self.rank, self.num_processes = rank, num_processes
        self.epoch, self.start_step = 0, 0
        # Progressive resizing (data.progressive.Schedule.size_at): the image size of each global step, which
        # the keys carry to the dataset as their fourth part.
        self.size_at = size_at

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return batching.steps_per_epoch(self.n, self.global_batch) - self.start_step

    def global_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch, "order"))
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self):
        order, per_epoch = self.global_order(self.epoch), batching.steps_per_epoch(self.n, self.global_batch)
        for step in range(self.start_step, per_epoch):
            chunk = order[step * self.global_batch:(step + 1) * self.global_batch]
            share = batching.rank_slice(chunk, self.rank, self.num_processes)
            size = () if self.size_at is None else (self.size_at(self.epoch * per_epoch + step),)
            yield ([(i, self.epoch, len(chunk), *size) for i in share]
                   or [(NO_SAMPLE, self.epoch, len(chunk), *size)])


class SeededRNG:
    """Seed python/numpy/torch RNGs for one sample and restore them after, so augmentation is a pure
    function of (seed, epoch, index), whatever the worker count, and the caller's RNGs are untouched.

    Only the CPU torch generator is seeded (torch.manual_seed would also reseed CUDA's and costs
    0.13 ms). Inside a loader worker nothing else draws from these RNGs, so nothing is saved or
    restored there: numpy's get/set_state alone costs ~0.1 ms, a tenth of decoding a 500x375 JPEG.
    """

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._restore = torch.utils.data.get_worker_info() is None
        if self._restore:
            self._py, self._np = random.getstate(), np.random.get_state()
            self._t = torch.default_generator.get_state()
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.default_generator.manual_seed(self.seed)

    def __exit__(self, *exc):
        if self._restore:
            random.setstate(self._py)
            np.random.set_state(self._np)
            torch.default_generator.set_state(self._t)
