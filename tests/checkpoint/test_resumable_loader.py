"""ResumableDataLoader on its own: what is skipped (never loaded), the epoch check, worker prefetch and seeds,
and resuming at another world size or batch size (ranks simulated by ``DistributedSampler(num_replicas, rank)``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, RandomSampler

from lightning_fastdist.data import EpochShuffleSampler, ResumableDataLoader

SAMPLES = 64


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
    state = first.state_dict()
    assert state == {
        "epoch": 0,
        "batches": 2,
        "samples": 8,
        "world_size": 1,
        "batch_size": 4,
        "order": ["shuffled", 3, 24],
    }

    dataset = CountingDataset()
    resumed = loader(dataset)
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch in resumed]
    assert consumed + rest == [batch.tolist() for batch in loader(CountingDataset())]
    assert dataset.loads == 16  # the 2 skipped batches were never loaded
    assert len(resumed) == 6  # Lightning still sees the whole epoch
    assert resumed.state_dict()["batches"] == 6 and resumed.state_dict()["samples"] == 24


def test_a_position_saved_in_another_epoch_is_not_applied():
    first = loader(CountingDataset())
    batches = iter(first)
    for _ in range(5):
        next(batches)
    resumed = loader(CountingDataset())
    resumed.load_state_dict(first.state_dict())
    resumed.sampler.set_epoch(1)  # Lightning moved on to the next epoch
    assert len(list(resumed)) == 6


def test_worker_prefetch_does_not_count_as_consumed():
    with_workers = loader(CountingDataset(), num_workers=1, prefetch_factor=4)
    batches = iter(with_workers)
    next(batches)
    assert with_workers.state_dict()["batches"] == 1


class WorkerSeed(Dataset):
    """Every item is the torch seed of the process that loads it (a worker's is its base seed + worker id)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return torch.initial_seed()


def test_worker_seeds_follow_the_global_seed_and_epoch_and_leave_the_global_generator_alone():
    def worker_seed(epoch: int, draws_before: int) -> tuple[int, torch.Tensor]:
        torch.manual_seed(7)
        torch.rand(draws_before)  # whatever ran before the epoch started
        epoch_loader = ResumableDataLoader(
            WorkerSeed(), batch_size=4, sampler=EpochShuffleSampler(range(4)), num_workers=1
        )
        epoch_loader.sampler.set_epoch(epoch)
        expected_next = torch.get_rng_state()
        seed = int(next(iter(epoch_loader))[0])
        assert torch.equal(torch.get_rng_state(), expected_next)  # starting the epoch drew nothing
        return seed

    assert worker_seed(0, draws_before=0) == worker_seed(0, draws_before=5)
    assert worker_seed(0, draws_before=0) != worker_seed(1, draws_before=0)


def test_epoch_order_depends_only_on_seed_and_epoch():
    a, b = EpochShuffleSampler(range(10), seed=1), EpochShuffleSampler(range(10), seed=1)
    list(a)  # iterating does not move any state
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b) and sorted(b) == list(range(10))
    assert torch.equal(torch.tensor(sorted(a)), torch.arange(10))


def test_epoch_shuffle_reads_distributed_samplers_order_with_the_seed_everything_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")  # what seed_everything(42) sets
    ours, lightnings = (
        EpochShuffleSampler(range(SAMPLES)),
        DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, seed=42),
    )
    for epoch in (0, 3):
        ours.set_epoch(epoch)
        lightnings.set_epoch(epoch)
        assert list(ours) == list(lightnings)


# ---------------------------------------------------------------- another world size or batch size


def rank_loaders(world_size: int, batch_size: int, sampler=None) -> list[ResumableDataLoader]:
    """One training loader per rank, as Lightning builds them (one process keeps the module's sampler)."""
    data = range(SAMPLES)
    if world_size == 1:
        return [
            ResumableDataLoader(
                data, batch_size=batch_size, sampler=sampler or EpochShuffleSampler(data, seed=0), drop_last=True
            )
        ]
    return [
        ResumableDataLoader(
            data, batch_size=batch_size, sampler=DistributedSampler(data, world_size, rank, seed=0), drop_last=True
        )
        for rank in range(world_size)
    ]


def train_steps(loaders: list[ResumableDataLoader], steps: int | None) -> list[list[int]]:
    """Global batches: every rank's batch of each step, in rank order.

    All batches of the epoch when ``steps`` is None.
    """
    iterators = [iter(rank_loader) for rank_loader in loaders]
    global_batches = []
    for step_batches in zip(*iterators):
        global_batches.append([index for batch in step_batches for index in batch.tolist()])
        if len(global_batches) == steps:
            break
    return global_batches


@pytest.mark.parametrize(
    ("before", "after", "steps_before", "count_after"),
    [
        ((2, 4), (1, 8), 3, 3),  # the same global batch: the same batch count
        ((2, 4), (1, 4), 3, 6),
        ((1, 8), (2, 4), 3, 3),
        ((1, 4), (2, 4), 4, 2),
        ((2, 4), (4, 2), 5, 5),
        ((2, 4), (4, 4), 2, 1),
        ((1, 4), (3, 4), 3, 1),  # 3 ranks: DistributedSampler pads 64 to 66 samples; drop_last leaves out 2 per rank
    ],
)
def test_another_world_size_continues_at_the_next_sample(before, after, steps_before, count_after):
    first = rank_loaders(*before)
    seen = train_steps(first, steps_before)
    resumed = rank_loaders(*after)
    for rank_loader in resumed:
        rank_loader.load_state_dict(first[0].state_dict())  # rank 0's state is the one in the checkpoint
        assert rank_loader.resume_batch_count(0) == count_after
    rest = train_steps(resumed, None)
    read = [index for batch in seen + rest for index in batch]
    # Each sample that an uninterrupted run at the new size reads in the epoch, exactly once.
    assert len(set(read)) == len(read)
    assert sorted(read) == sorted(index for batch in train_steps(rank_loaders(*after), None) for index in batch)
    if before[0] * before[1] == after[0] * after[1]:  # the global batches of an uninterrupted run
        assert [sorted(batch) for batch in seen + rest] == [
            sorted(batch) for batch in train_steps(rank_loaders(*before), None)
        ]


@pytest.mark.parametrize(
    ("before", "after", "steps_before", "sampler", "message"),
    [
        (
            (2, 4),
            (1, 8),
            3,
            EpochShuffleSampler(range(SAMPLES), seed=5),
            r"reads another order \(\['shuffled', 5, 64\], the checkpoint's: \['shuffled', 0, 64\]\)",
        ),
        ((2, 4), (1, 8), 3, RandomSampler(range(SAMPLES)), "the sampler's order is not known"),
        ((1, 4), (2, 4), 3, None, "drop_last would skip 4 samples of the epoch that an uninterrupted run reads"),
        ((2, 4), (3, 4), 1, None, r"its ranks would be left with different numbers of batches \(\[4, 4, 5\]\)"),
    ],
)
def test_a_resume_that_would_repeat_or_skip_samples_is_refused(before, after, steps_before, sampler, message):
    first = rank_loaders(*before)
    train_steps(first, steps_before)
    resumed = rank_loaders(*after, sampler=sampler)[0]
    resumed.load_state_dict(first[0].state_dict())
    with pytest.raises(ValueError, match=message) as refused:
        resumed.resume_batch_count(0)
    assert "\n" not in str(refused.value) and "Resume at" in str(refused.value)


def test_a_batch_count_that_no_trainer_moves_is_refused():
    first = rank_loaders(2, 4)
    train_steps(first, 3)
    resumed = rank_loaders(1, 4)[0]
    resumed.load_state_dict(first[0].state_dict())
    with pytest.raises(ValueError, match=r"\(batch 3 at 2 ranks x batch 4\) is batch 6 here"):
        next(iter(resumed))  # resume_batch_count was not called: Lightning would still count 3 batches
