"""A plain ``DataLoader`` continued inside an epoch, exactly where its order can be found again.

Lightning restarts a plain loader's epoch from its first batch on a mid-epoch resume (batches trained twice, others
never). Where the order depends on the sampler's seed and epoch alone (``DistributedSampler``, which Lightning puts
under every training loader of a distributed run, or ``SequentialSampler``) over a map-style dataset, the resumed
epoch skips the indices the checkpoint's run had read, without reading them again. Elsewhere (an ``IterableDataset``,
a sampler that draws from the global generator) the order cannot be found again: Lightning's behaviour stays, and one
line says what the resume repeats or skips and how to make it exact (``docs/fault-tolerance.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, SequentialSampler

from lightning_fastdist.data.resumable_loader import ResumableDataLoader

_SEEDED = (DistributedSampler, SequentialSampler)  # orders their seed and epoch alone decide
EXACT_INSTEAD = (
    "for an exact resume, train from a map-style Dataset (Lightning's sampler then gives its order again) or "
    "lightning_fastdist.data.ResumableDataLoader"
)


def order_is_reproducible(dataloader: object) -> bool:
    """Whether ``dataloader`` reads a map-style dataset in an order its sampler's seed and epoch alone decide, batched
    by a plain ``BatchSampler`` (so the items an epoch's first batches read are known)."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return False
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        return False
    sampler = dataloader.sampler
    return any(isinstance(sampler, cls) and type(sampler).__iter__ is cls.__iter__ for cls in _SEEDED)


class ResumedEpochSampler(Sampler):
    """``sampler``, minus the first ``consumed`` items of epoch ``epoch`` (the first time that epoch is read).

    Its length stays the sampler's: Lightning counts the skipped batches as done. ``set_epoch`` reaches the sampler.
    """

    def __init__(self, sampler: Sampler, epoch: int, consumed: int) -> None:
        self.sampler = sampler
        self.resumed_epoch = epoch
        self.consumed = consumed
        self.epoch = getattr(sampler, "epoch", 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.epoch != self.resumed_epoch or self.consumed == 0:
            return iter(self.sampler)
        consumed, self.consumed = self.consumed, 0  # once: the epoch read again later is whole
        return islice(iter(self.sampler), consumed, None)


def continue_epoch(dataloader: object, epoch: int, batches: int) -> object:
    """``dataloader`` for a fit that resumes epoch ``epoch`` after its first ``batches`` batches: a copy that skips them
    without reading where the order is reproducible; else ``dataloader`` itself, with one line saying that, as under
    Lightning, the epoch's first batches are read again."""
    if isinstance(dataloader, ResumableDataLoader) or batches == 0:
        return dataloader
    if not order_is_reproducible(dataloader):
        rank_zero_warn(
            f"Resuming epoch {epoch} after its batch {batches}: this training loader's order cannot be found again "
            f"({_why_not(dataloader)}), so, as under Lightning, it is read from the epoch's start and its first "
            f"{batches} batches are trained again; {EXACT_INSTEAD}."
        )
        return dataloader
    assert isinstance(dataloader, DataLoader) and dataloader.batch_size is not None
    sampler = ResumedEpochSampler(dataloader.sampler, epoch, batches * dataloader.batch_size)
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def cut_short_line(epoch: int, batches: int, total: float) -> str:
    """What a resume skips when an epoch cut short (``max_steps``) cannot be continued: Lightning's next epoch
    (``total``: the epoch's batches, ``inf`` where the loader has no length)."""
    rest = f"its batches {batches + 1} to {int(total)}" if total != float("inf") else "the rest of it"
    return (
        f"This checkpoint was taken after batch {batches} of epoch {epoch}, and a training loader's order cannot be "
        f"found again: as under Lightning, a resume goes on with epoch {epoch + 1} and skips {rest}; "
        f"{EXACT_INSTEAD}."
    )


def _why_not(dataloader: object) -> str:
    if not isinstance(dataloader, DataLoader):
        return f"a {type(dataloader).__name__}, not a DataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return "an IterableDataset"
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        return f"its batch sampler is a {type(dataloader.batch_sampler).__name__}"
    return f"its {type(dataloader.sampler).__name__} draws its order from the global random generator"
