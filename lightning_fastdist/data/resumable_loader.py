"""ResumableDataLoader: a DataLoader that continues a restarted epoch where the checkpoint left it.

Lightning saves the ``state_dict()`` of every training loader that has one in
the checkpoint's loop state and hands it back through ``load_state_dict`` before
the resumed epoch starts (without it, Lightning 2.6 restarts a mid-epoch resume
from the epoch's first batch, so some samples are seen twice and others never).
This loader's state is the epoch its sampler was on and the number of batches it
handed out in it. On resume it skips those batches by drawing their indices from
the sampler without loading them, so the resumed run sees exactly the batches an
uninterrupted run would have seen next, on every rank.

The epoch is read from the sampler's ``epoch`` attribute (``DistributedSampler``
and :class:`~lightning_fastdist.data.EpochShuffleSampler` have one; Lightning
sets it before each epoch), so a checkpoint taken at the very end of an epoch
does not make the next epoch skip anything. With a sampler that has no
``epoch``, the saved position applies to the next epoch that starts.

Skipping by index goes through ``DataLoader._index_sampler``, the (private,
stable since torch 1.x) property every DataLoader iterator reads its batch
indices from; if an iterator stops reading it, resuming raises instead of
skipping nothing (and ``tests/test_resumable_loader.py`` fails).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader

STATE_KEYS = ("epoch", "batches")


class _SkipFirst(Iterable):
    """The loader's index sampler, minus the first ``loader._skip_next`` batches of the iteration that starts next."""

    def __init__(self, index_sampler: Iterable, loader: ResumableDataLoader) -> None:
        self.index_sampler = index_sampler
        self.loader = loader

    def __len__(self) -> int:
        assert isinstance(self.index_sampler, Sized)
        return len(self.index_sampler)  # the full epoch: Lightning counts the skipped batches as done

    def __iter__(self) -> Iterator[Any]:
        skip, self.loader._skip_next = self.loader._skip_next, 0
        indices = iter(self.index_sampler)
        for _ in range(skip):
            next(indices, None)
        yield from indices


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` whose position inside an epoch is saved in Lightning checkpoints.

    Takes exactly the arguments of ``DataLoader`` (so Lightning can rebuild it
    with a ``DistributedSampler``). Map-style datasets only: an iterable dataset
    has no sampler to skip through.
    """

    _epoch: int | None = None  # the sampler's epoch of the current iteration
    _batches: int = 0  # batches handed out in the current iteration
    _pending: dict[str, Any] | None = None  # a loaded state not yet applied
    _skip_next: int = 0  # batches the next index iteration skips

    @property
    def _index_sampler(self) -> Iterable:  # read by DataLoader's iterators for the indices of each batch
        return _SkipFirst(super()._index_sampler, self)

    def _sampler_epoch(self) -> int | None:
        batch_sampler = self.batch_sampler
        for sampler in (self.sampler, getattr(batch_sampler, "sampler", None)):
            if isinstance(getattr(sampler, "epoch", None), int):
                return sampler.epoch
        return None

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator: nothing runs until the first batch is requested, after Lightning has set the epoch.
        epoch = self._sampler_epoch()
        pending, self._pending = self._pending, None
        skip = pending["batches"] if pending is not None and pending["epoch"] == epoch else 0
        self._epoch, self._batches, self._skip_next = epoch, skip, skip
        for batch in super().__iter__():
            if self._skip_next:
                # The iterator drew its indices without going through _index_sampler (a torch change):
                # fail loudly rather than resume at the wrong position.
                raise RuntimeError("ResumableDataLoader: this torch's DataLoader bypasses _index_sampler; cannot resume mid-epoch.")
            self._batches += 1  # counted before it is handed out: a checkpoint taken during its step includes it
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": sampler epoch or None, "batches": batches handed out in it}``."""
        if self._pending is not None:
            return dict(self._pending)
        return {"epoch": self._epoch, "batches": self._batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Skip ``state_dict["batches"]`` batches when the saved epoch starts again.

        Raises:
            ValueError: the state is not one :meth:`state_dict` wrote.
        """
        if sorted(state_dict) != sorted(STATE_KEYS):
            raise ValueError(f"ResumableDataLoader: expected a state with keys {STATE_KEYS}, got {sorted(state_dict)}.")
        self._pending = dict(state_dict)
