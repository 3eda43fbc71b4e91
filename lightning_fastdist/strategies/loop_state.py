"""Lightning's loop progress made to agree with where the training data stands, on save and on resume.

- **An epoch cut short** by ``max_steps`` (or ``should_stop``): Lightning marks it processed, so a checkpoint
  written then would resume at the next epoch. :func:`reopen_epoch_cut_short` writes its epoch as unfinished, the
  form Lightning gives a checkpoint taken inside an epoch; plain Lightning reads it the same way.
- **Another world size or batch size**: a :class:`~lightning_fastdist.data.ResumableDataLoader` resumes by samples,
  which can be another number of batches; :func:`align_resumed_batch_count` moves Lightning's count there, so the
  epoch ends after its real last batch.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_fastdist.data import ResumableDataLoader, ResumeRefusedError


def reopen_epoch_cut_short(checkpoint: dict[str, Any]) -> None:
    """Mark the checkpoint's epoch unfinished if it ended before its last batch (in place)."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if loop is None:
        return
    epochs, batches = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
    ran_batches = batches["current"]["ready"] > 0
    marked_processed = epochs["current"]["processed"] == epochs["current"]["started"] > 0
    if not (ran_batches and marked_processed and not batches["is_last_batch"]):
        return
    for tracker in (epochs["current"], epochs["total"]):
        tracker["processed"] -= 1
        tracker["completed"] = tracker["processed"]
    checkpoint["epoch"] = epochs["current"]["completed"]


def _training_loaders(trainer: pl.Trainer) -> list[Any]:
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def align_resumed_batch_count(trainer: pl.Trainer) -> None:
    """Set the resumed epoch's batch count to where its training loader resumes (at the start of a resumed fit).

    Raises:
        ResumeRefusedError: several training loaders resume at different batches.
    """
    epoch = trainer.fit_loop.epoch_progress.current.processed
    counts = {
        count
        for loader in _training_loaders(trainer)
        if isinstance(loader, ResumableDataLoader) and (count := loader.resume_batch_count(epoch)) is not None
    }
    if not counts:
        return
    if len(counts) > 1:
        raise ResumeRefusedError(
            f"ResumableDataLoader: the training loaders resume epoch {epoch} at different batches {sorted(counts)}."
        )
    progress = trainer.fit_loop.epoch_loop.batch_progress
    shift = counts.pop() - progress.current.ready
    for tracker in (progress.current, progress.total):
        tracker.ready += shift
        tracker.started += shift
        tracker.processed += shift
        tracker.completed += shift
