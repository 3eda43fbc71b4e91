"""Where each rank reads in an epoch's global sample order, for the samplers whose order is known.

``DistributedSampler`` deals one permutation out to the ranks in turn, so after ``k`` batches of ``b`` per rank the
ranks have read the first ``k * b * W`` positions whatever the world size ``W``: a resume at another world size finds
its place by counting positions. ``EpochShuffleSampler`` and ``SequentialSampler`` give its one-replica orders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import DistributedSampler, SequentialSampler

from lightning_fastdist.data.epoch_shuffle import EpochShuffleSampler


@dataclass(frozen=True)
class EpochShare:
    """One rank's share of an epoch.

    Attributes:
        order: ``["shuffled", seed, length]`` or ``["sequential", length]``; ``None`` when the sampler's order is
            not known (then positions cannot be counted).
        samples: items this rank reads in an epoch.
    """

    order: list[Any] | None
    world_size: int
    rank: int
    samples: int


def _iterates_as(sampler: Any, cls: type) -> bool:
    # A subclass that overrides __iter__ (Lightning's DistributedSamplerWrapper does) has its own order.
    return isinstance(sampler, cls) and type(sampler).__iter__ is cls.__iter__


def epoch_share(sampler: Any) -> EpochShare:
    """The share of the epoch ``sampler`` hands this rank."""
    if _iterates_as(sampler, DistributedSampler):
        length = len(sampler.dataset)
        order = ["shuffled", sampler.seed, length] if sampler.shuffle else ["sequential", length]
        return EpochShare(order, sampler.num_replicas, sampler.rank, sampler.num_samples)
    if _iterates_as(sampler, EpochShuffleSampler):
        return EpochShare(["shuffled", sampler.seed, len(sampler)], 1, 0, len(sampler))
    if _iterates_as(sampler, SequentialSampler):
        return EpochShare(["sequential", len(sampler)], 1, 0, len(sampler))
    return EpochShare(None, getattr(sampler, "num_replicas", 1), getattr(sampler, "rank", 0), len(sampler))


def positions_read_before(position: int, rank: int, world_size: int) -> int:
    """How many of the positions ``0 .. position - 1`` rank ``rank`` of ``world_size`` reads."""
    return max(0, -(-(position - rank) // world_size))
