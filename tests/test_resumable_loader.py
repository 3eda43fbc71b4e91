"""ResumableDataLoader on its own: batches skipped by index (never loaded), the epoch check, worker prefetch."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lightning_fastdist.data import EpochShuffleSampler, ResumableDataLoader


class CountingDataset(Dataset):
    """Items 0..n-1 that count how often they are loaded."""

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.loads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loads += 1
        return index


def loader(dataset: Dataset, **options) -> ResumableDataLoader:
    return ResumableDataLoader(dataset, batch_size=4, sampler=EpochShuffleSampler(dataset, seed=3), **options)


def test_resume_skips_consumed_batches_without_loading_them():
    first = loader(CountingDataset())
    batches = iter(first)
    consumed = [next(batches).tolist() for _ in range(2)]
    assert first.state_dict() == {"epoch": 0, "batches": 2}

    dataset = CountingDataset()
    resumed = loader(dataset)
    resumed.load_state_dict(first.state_dict())
    rest = [batch.tolist() for batch in resumed]
    assert consumed + rest == [batch.tolist() for batch in loader(CountingDataset())]
    assert dataset.loads == 16  # the 2 skipped batches were never loaded
    assert len(resumed) == 6  # Lightning still sees the whole epoch
    assert resumed.state_dict() == {"epoch": 0, "batches": 6}


def test_a_position_saved_in_another_epoch_is_not_applied():
    resumed = loader(CountingDataset())
    resumed.load_state_dict({"epoch": 0, "batches": 5})
    resumed.sampler.set_epoch(1)  # Lightning moved on to the next epoch
    assert len(list(resumed)) == 6


def test_worker_prefetch_does_not_count_as_consumed():
    with_workers = loader(CountingDataset(), num_workers=1, prefetch_factor=4)
    batches = iter(with_workers)
    next(batches)
    assert with_workers.state_dict() == {"epoch": 0, "batches": 1}


def test_epoch_order_depends_only_on_seed_and_epoch():
    a, b = EpochShuffleSampler(range(10), seed=1), EpochShuffleSampler(range(10), seed=1)
    list(a)  # iterating does not move any state
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b) and sorted(b) == list(range(10))
    assert torch.equal(torch.tensor(sorted(a)), torch.arange(10))
