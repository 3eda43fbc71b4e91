"""A shuffling sampler whose order is a function of ``(seed, epoch)`` alone."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import RandomSampler


class EpochShuffleSampler(RandomSampler):
    """Every index once per epoch, in an order fixed by ``seed + epoch`` alone.

    ``RandomSampler``'s generator state moves on every epoch, so a run restarted from a checkpoint would see another
    order unless that state was saved. Lightning sets the epoch through :meth:`set_epoch`, as for
    ``DistributedSampler``. Subclassing ``RandomSampler`` makes Lightning treat it as shuffling and swap in a
    ``DistributedSampler`` under several processes; the order is that sampler's with one replica, so every world size
    reads the same permutation per epoch.

    Args:
        data_source: the dataset (only its length is used).
        seed: ``None``: the ``seed_everything`` seed (``PL_GLOBAL_SEED``, 0 when unset), the seed Lightning gives the
            ``DistributedSampler`` that replaces this one.
    """

    def __init__(self, data_source: Sized, seed: int | None = None) -> None:
        super().__init__(data_source)
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the order of epoch ``epoch`` (called by Lightning before each epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()
