"""A shuffling sampler whose order is a function of ``(seed, epoch)`` alone."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import RandomSampler


class EpochShuffleSampler(RandomSampler):
    """Every index once per epoch, in an order fixed by ``seed`` and the epoch number.

    ``torch.utils.data.RandomSampler`` draws each epoch's order from a generator
    whose state moves on every epoch, so a run restarted from a checkpoint sees a
    different order unless that state was saved. Here the order depends on
    nothing but ``seed + epoch``, which Lightning sets through :meth:`set_epoch`
    before each epoch (as it does for ``DistributedSampler``). It subclasses
    ``RandomSampler`` so that Lightning recognises it as shuffling and replaces it
    with a ``DistributedSampler`` (also ordered by seed and epoch) when it runs
    several processes.

    Args:
        data_source: the dataset (only its length is used).
        seed: seed of the shuffle; the same seed gives the same order per epoch.
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the order of epoch ``epoch`` (called by Lightning before each epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()
