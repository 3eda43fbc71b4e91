"""ResumableDataLoader: a DataLoader that continues a restarted epoch where the checkpoint left it.

Lightning alone restarts a mid-epoch resume from the epoch's first batch (samples seen twice, others never). This
loader saves the positions of the epoch's global order read (:mod:`.epoch_order`) and skips them without loading, so
a resume is exact at another world size or batch size too, or refused in one line. ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from lightning_fastdist.data.epoch_order import EpochShare, epoch_share, positions_read_before

STATE_KEYS = ("epoch", "batches", "samples", "world_size", "batch_size", "order")


class ResumeRefusedError(ValueError):
    """A checkpoint's data position cannot be continued exactly here; the message says what would go wrong."""


@dataclass(frozen=True)
class _Resume:
    """Where a resumed epoch starts on this rank.

    Attributes:
        batches: this rank's batches of the epoch counted as done, in this run's batch size.
        samples: positions of the epoch's global order read so far, or ``None`` when not counted.
        skip_items: sampler items to skip before batching the rest; ``None``: skip ``batches`` whole batches.
    """

    batches: int
    samples: int | None
    skip_items: int | None


class _SkipFirst(Iterable):
    """The loader's index sampler, minus what ``loader._resume_next`` says the next iteration skips."""

    def __init__(self, index_sampler: Iterable, loader: ResumableDataLoader) -> None:
        self.index_sampler = index_sampler
        self.loader = loader

    def __len__(self) -> int:
        assert isinstance(self.index_sampler, Sized)
        return len(self.index_sampler)  # the full epoch: Lightning counts the skipped batches as done

    def __iter__(self) -> Iterator[Any]:
        resume, self.loader._resume_next = self.loader._resume_next, None
        if resume is not None and resume.skip_items is not None:
            rest = islice(iter(self.loader.sampler), resume.skip_items, None)
            yield from BatchSampler(rest, self.loader.batch_size, self.loader.drop_last)  # type: ignore[arg-type]
            return
        indices = iter(self.index_sampler)
        for _ in range(resume.batches if resume is not None else 0):
            next(indices, None)
        yield from indices


class ResumableDataLoader(DataLoader):
    """``DataLoader`` whose position inside an epoch is saved in Lightning checkpoints.

    Takes exactly ``DataLoader``'s arguments, so Lightning can rebuild it with a ``DistributedSampler``. Map-style
    datasets only: an iterable dataset has no sampler to skip through.
    """

    _epoch: int | None = None  # the sampler's epoch of the current iteration
    _batches: int = 0  # batches of the current epoch counted as done
    _samples: int | None = 0  # positions of the epoch's global order read, None when not counted
    _pending: dict[str, Any] | None = None  # a loaded state not yet applied
    _resume_next: _Resume | None = None  # what the next index iteration skips
    _count_taken: bool = False  # a trainer asked for the resumed batch count (and sets its own to it)

    # DataLoader's iterators read this private property for each batch's indices; should a torch version stop
    # reading it, __iter__ raises rather than resume at the wrong position.
    @property
    def _index_sampler(self) -> Iterable:
        return _SkipFirst(super()._index_sampler, self)

    def _sampler_epoch(self) -> int | None:
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if isinstance(getattr(sampler, "epoch", None), int):
                return sampler.epoch
        return None

    def _counts_positions(self, share: EpochShare) -> bool:
        return share.order is not None and self.batch_size is not None

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing runs until the first batch is requested, after Lightning has set the epoch.
        epoch = self._sampler_epoch()
        pending, self._pending = self._pending, None
        resume = self._plan(pending) if pending is not None and pending["epoch"] == epoch else None
        if resume is not None and resume.batches != pending["batches"] and not self._count_taken:
            raise ResumeRefusedError(
                f"ResumableDataLoader: the checkpoint's position in epoch {epoch} (batch {pending['batches']} at "
                f"{_geometry(pending['world_size'], pending['batch_size'])}) is batch {resume.batches} here, and this "
                "trainer's strategy does not move Lightning's batch count (FastDDPStrategy and FastFSDPStrategy do); "
                "resume with the same world size x batch size, or with one of those strategies."
            )
        share = epoch_share(self.sampler)
        if resume is None:
            resume = _Resume(0, 0 if self._counts_positions(share) else None, None)
        self._epoch, self._batches, self._samples = epoch, resume.batches, resume.samples
        self._resume_next, self._count_taken = resume, False
        for batch in self._epoch_iterator(epoch):
            if self._resume_next is not None:  # the iterator drew its indices without _index_sampler
                raise RuntimeError(
                    "ResumableDataLoader: this torch's DataLoader bypasses _index_sampler; cannot resume mid-epoch."
                )
            # Counted before it is handed out: a checkpoint taken during its step includes it.
            self._batches += 1
            if self._samples is not None:
                self._samples += self.batch_size * share.world_size
            yield batch

    def _epoch_iterator(self, epoch: int | None) -> Iterator[Any]:
        # Workers' base seed from the global seed and the epoch, as in an uninterrupted run.
        if self.generator is not None:
            return super().__iter__()
        with torch.random.fork_rng(devices=[]):  # the global CPU generator is as it was afterwards
            torch.default_generator.manual_seed((torch.initial_seed() + (epoch or 0)) % 2**63)
            return super().__iter__()  # draws the workers' base seed (and starts them)

    def _plan(self, saved: dict[str, Any]) -> _Resume:
        """Where this rank resumes the saved epoch; raises ``ValueError`` when it cannot find the place."""
        share = epoch_share(self.sampler)
        if None not in (saved["order"], share.order) and saved["order"] != share.order:
            self._refuse(
                saved,
                f"this run's sampler reads another order ({share.order}, the checkpoint's: {saved['order']}), "
                "so samples would be repeated and skipped",
            )
        if saved["samples"] is not None and self._counts_positions(share):
            return self._plan_by_position(saved, share)
        if (saved["world_size"], saved["batch_size"]) != (share.world_size, self.batch_size):
            self._refuse(
                saved,
                "the sampler's order is not known (DistributedSampler, EpochShuffleSampler and SequentialSampler have "
                "known orders), so the position is only known in batches of the checkpoint's size and counting them "
                "here would repeat or skip samples",
            )
        return _Resume(saved["batches"], None, None)

    def _plan_by_position(self, saved: dict[str, Any], share: EpochShare) -> _Resume:
        position = saved["samples"]
        skips = [positions_read_before(position, rank, share.world_size) for rank in range(share.world_size)]
        rest = [max(0, share.samples - skip) for skip in skips]
        left = [self._batches_in(items) for items in rest]
        if len(set(left)) > 1:
            self._refuse(saved, f"its ranks would be left with different numbers of batches ({left}) and hang")
        # drop_last leaves out each rank's last partial batch: never more than an uninterrupted run does.
        skipped = sum(max(0, self._left_out(items) - self._left_out(share.samples)) for items in rest)
        if skipped:
            self._refuse(saved, f"drop_last would skip {skipped} samples of the epoch that an uninterrupted run reads")
        return _Resume(self._batches_in(share.samples) - left[share.rank], position, skips[share.rank])

    def _batches_in(self, items: int) -> int:
        assert self.batch_size is not None
        return items // self.batch_size if self.drop_last else -(-items // self.batch_size)

    def _left_out(self, items: int) -> int:
        assert self.batch_size is not None
        return items % self.batch_size if self.drop_last else 0

    def _refuse(self, saved: dict[str, Any], reason: str) -> None:
        share = epoch_share(self.sampler)
        read = f"{saved['samples']} samples read" if saved["samples"] is not None else f"{saved['batches']} batches"
        then, now = _geometry(saved["world_size"], saved["batch_size"]), _geometry(share.world_size, self.batch_size)
        raise ResumeRefusedError(
            f"ResumableDataLoader: cannot continue epoch {saved['epoch']} at {now} "
            f"from where {then} left it ({read}): {reason}. Resume at {then}, or from a checkpoint taken at the end "
            "of an epoch."
        )

    def resume_batch_count(self, epoch: int) -> int | None:
        """Batches of ``epoch`` a trainer must count as done when this loader resumes it (``None``: no state applies).

        After a change of world size or batch size this differs from the checkpoint's loop state; the caller sets its
        count to it (without a caller such a resume is refused: Lightning would end the epoch at the wrong batch).

        Raises:
            ValueError: the resume cannot find its place.
        """
        if self._pending is None or self._pending["epoch"] != epoch:
            return None
        self._count_taken = True
        return self._plan(self._pending).batches

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch (:data:`STATE_KEYS`).

        ``batches``: this rank's batches done; ``samples``: positions of the epoch's global order read by all ranks
        together (``None`` when the order is unknown); ``order``: the permutation, as in ``EpochShare``.
        """
        if self._pending is not None:
            return dict(self._pending)
        share = epoch_share(self.sampler)
        return {
            "epoch": self._epoch,
            "batches": self._batches,
            "samples": self._samples if self._counts_positions(share) else None,
            "world_size": share.world_size,
            "batch_size": self.batch_size,
            "order": share.order,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Skip what ``state_dict`` says was read when its epoch starts again (``ValueError``: not a saved state)."""
        if sorted(state_dict) != sorted(STATE_KEYS):
            raise ValueError(f"ResumableDataLoader: expected a state with keys {STATE_KEYS}, got {sorted(state_dict)}.")
        self._pending = dict(state_dict)


def _geometry(world_size: int, batch_size: int | None) -> str:
    return f"{world_size} rank{'s' if world_size != 1 else ''} x batch {batch_size}"
