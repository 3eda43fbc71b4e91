"""A plain ``DataLoader`` continued inside an epoch, exactly where its order can be found again.

Lightning restarts a plain loader's epoch from its first batch on a mid-epoch resume (batches trained twice, others
never). Where the order depends on the sampler's seed and epoch alone (``DistributedSampler``, which Lightning puts
under every training loader of a distributed run, or ``SequentialSampler``) over a map-style dataset, the resumed
epoch skips the indices the checkpoint's run had read, without reading them again: for each loader of a
``CombinedLoader`` what that loader had read of its current pass (a loader ``max_size_cycle`` cycles starts again at its
end: its position is the epoch's batches modulo its length). Elsewhere (an ``IterableDataset``, a sampler that draws
from the global generator) the order cannot be found again: Lightning's behaviour stays, and one line says so and how
to make it exact (``docs/fault-tolerance.md``). A loader with its own ``state_dict`` and ``load_state_dict`` (LitData's
``StreamingDataLoader``, ``ResumableDataLoader``) is left to Lightning, which restores it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, SequentialSampler

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
    """``sampler``, minus the first ``consumed()`` items of epoch ``epoch`` (the first time that epoch is read: asked
    then, once the fit's loaders are all set up).

    Its length stays the sampler's: Lightning counts the skipped batches as done. ``set_epoch`` reaches the sampler.
    """

    def __init__(self, sampler: Sampler, epoch: int, consumed: Callable[[], int]) -> None:
        self.sampler = sampler
        self.resumed_epoch = epoch
        self.consumed: Callable[[], int] | None = consumed
        self.epoch = getattr(sampler, "epoch", 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.epoch != self.resumed_epoch or self.consumed is None:
            return iter(self.sampler)
        consumed, self.consumed = self.consumed(), None  # once: the epoch read again later is whole
        return islice(iter(self.sampler), consumed, None)


def one_loader() -> str:
    """The mode of a fit's single training loader, which Lightning wraps in a ``CombinedLoader`` of one."""
    return "max_size_cycle"


def batches_read_of_pass(mode: str, batches: int, length: int) -> int:
    """The batches a loader of ``length`` batches had read of its current pass after a ``CombinedLoader`` in ``mode``
    yielded ``batches`` in an epoch: ``max_size_cycle`` starts a shorter loader again at its end; ``max_size`` leaves an
    exhausted one exhausted; ``min_size`` ends the epoch at the shortest."""
    if mode == "max_size_cycle" and length > 0:
        return batches % length
    return min(batches, length)


def is_stateful(dataloader: object) -> bool:
    """Whether Lightning saves and restores ``dataloader`` itself (it has ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def continue_epoch(dataloader: object, epoch: int, batches: int, mode: Callable[[], str] = one_loader) -> object:
    """``dataloader`` for a fit that resumes epoch ``epoch`` after its first ``batches`` batches (``mode``: the training
    ``CombinedLoader``'s, asked once it is set up): a copy that skips what it had read without reading it where the
    order is reproducible; a stateful loader itself (Lightning restores it); else ``dataloader`` itself, with one line
    saying that, as under Lightning, it is read again from its first batch."""
    if is_stateful(dataloader) or batches == 0:
        return dataloader
    if not order_is_reproducible(dataloader):
        rank_zero_warn(
            f"Resuming epoch {epoch} after its batch {batches}: this training loader's order cannot be found again "
            f"({_why_not(dataloader)}), so, as under Lightning, it is read again from its first batch, not from where "
            f"the checkpoint's run stopped; {EXACT_INSTEAD}."
        )
        return dataloader
    assert isinstance(dataloader, DataLoader) and dataloader.batch_size is not None
    batch_size, length = dataloader.batch_size, len(dataloader)
    sampler = ResumedEpochSampler(
        dataloader.sampler, epoch, lambda: batches_read_of_pass(mode(), batches, length) * batch_size
    )
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
