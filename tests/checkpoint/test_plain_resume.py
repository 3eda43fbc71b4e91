"""A plain DataLoader continued inside an epoch: which orders can be found again, the sampler that skips what an epoch
read (once, without reading it), where each loader of a CombinedLoader stood, stateful loaders left to Lightning, and
the lines for the loaders whose order cannot be found again."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, TensorDataset

from lightning_fastdist.data import ResumableDataLoader
from lightning_fastdist.data.plain_resume import (
    ResumedEpochSampler,
    batches_read_of_pass,
    continue_epoch,
    cut_short_line,
    order_is_reproducible,
)

DATA = TensorDataset(torch.arange(40))


class Streamed(IterableDataset):
    def __iter__(self):
        yield from range(8)


def sharded(rank: int = 0) -> DataLoader:
    return DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=rank, seed=3))


def indices(loader: DataLoader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def test_orders_decided_by_seed_and_epoch_are_reproducible_the_others_are_not():
    assert order_is_reproducible(sharded()) and order_is_reproducible(DataLoader(DATA, batch_size=4))
    assert not order_is_reproducible(DataLoader(DATA, batch_size=4, shuffle=True))  # the global generator's draw
    assert not order_is_reproducible(DataLoader(Streamed(), batch_size=4))
    batches = BatchSampler(DistributedSampler(DATA, num_replicas=2, rank=0), 4, drop_last=False)
    assert order_is_reproducible(DataLoader(DATA, batch_sampler=batches)) is False  # batch_size is None
    assert not order_is_reproducible([1, 2, 3])


def test_the_resumed_epoch_skips_what_was_read_once_and_later_epochs_are_whole():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, seed=3)
    resumed = ResumedEpochSampler(sampler, epoch=2, consumed=lambda: 8)
    resumed.set_epoch(2)
    assert sampler.epoch == 2 and len(resumed) == len(sampler)  # Lightning counts the skipped batches as done
    sampler.set_epoch(2)
    whole = list(sampler)
    assert list(resumed) == whole[8:]
    assert list(resumed) == whole  # the same epoch read again (a second fit) is whole
    resumed.set_epoch(3)
    assert list(resumed) == list(sampler)


def test_a_plain_loader_continues_after_the_batches_read_without_reading_them():
    original = sharded(rank=0)
    original.sampler.set_epoch(1)
    expected = indices(original)[2:]
    continued = continue_epoch(original, epoch=1, batches=2)
    assert continued is not original and isinstance(continued.sampler, ResumedEpochSampler)
    continued.sampler.set_epoch(1)
    assert indices(continued) == expected
    assert continue_epoch(original, epoch=1, batches=0) is original


def test_a_stateful_loader_is_left_to_lightning_without_a_line():
    resumable = ResumableDataLoader(DATA, batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert continue_epoch(resumable, epoch=1, batches=2) is resumable  # Lightning restores it
    assert caught == []


@pytest.mark.parametrize(
    ("mode", "batches", "expected"),
    [
        ("max_size_cycle", 4, 1),
        ("max_size_cycle", 3, 0),
        ("max_size_cycle", 2, 2),
        ("max_size", 4, 3),
        ("min_size", 2, 2),
    ],
)
def test_a_combined_loaders_loader_continues_where_it_stood_in_its_mode(mode, batches, expected):
    """A loader of 3 batches in a CombinedLoader that yielded ``batches``: cycled, it had started again at its end."""
    assert batches_read_of_pass(mode, batches, 3) == expected
    original = sharded(rank=1)  # 5 batches
    original.sampler.set_epoch(0)
    whole = indices(original)
    continued = continue_epoch(original, epoch=0, batches=batches, mode=lambda: mode)
    continued.sampler.set_epoch(0)
    assert indices(continued) == whole[batches_read_of_pass(mode, batches, len(original)) :]


@pytest.mark.parametrize(
    ("loader", "why"),
    [
        (DataLoader(Streamed(), batch_size=4), "(an IterableDataset)"),
        (DataLoader(DATA, batch_size=4, sampler=RandomSampler(DATA)), "its RandomSampler draws its order from"),
    ],
)
def test_a_loader_whose_order_is_lost_is_read_as_under_lightning_and_one_line_says_so(loader, why):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert continue_epoch(loader, epoch=1, batches=3) is loader
    (line,) = [str(warning.message) for warning in caught]
    assert line.startswith("Resuming epoch 1 after its batch 3: this training loader's order cannot be found again")
    assert why in line and "read again from its first batch, not from where the checkpoint's run stopped" in line
    assert "ResumableDataLoader" in line


def test_the_line_for_an_epoch_cut_short_names_what_the_resume_skips():
    assert "goes on with epoch 2 and skips its batches 3 to 4;" in cut_short_line(1, 2, 4)
    assert "goes on with epoch 2 and skips the rest of it;" in cut_short_line(1, 2, float("inf"))
