"""Lightning's loop progress made to agree with where the training data stands: on resume (an epoch cut short by
``max_steps``, which Lightning's checkpoint marks finished, is continued in the loaded state; a loader that resumes by
samples may be at another batch count) and when a node rejoins a running job (it takes the position a live node sent).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.loop import _Loop

from lightning_fastdist.data import ResumableDataLoader, ResumeRefusedError


def epoch_cut_short(checkpoint: dict[str, Any]) -> tuple[int, int] | None:
    """``(epoch, batches run)`` of the checkpoint's epoch if it ended before its last batch (a ``max_steps`` stop),
    which Lightning marks finished: a resume would go on with the next epoch."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if loop is None:
        return None
    epochs, batches = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
    ran_batches = batches["current"]["ready"] > 0
    marked_processed = epochs["current"]["processed"] == epochs["current"]["started"] > 0
    if not (ran_batches and marked_processed and not batches["is_last_batch"]):
        return None
    return epochs["current"]["processed"] - 1, batches["current"]["ready"]


def ends_an_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether the next training batch after this checkpoint opens a new epoch (its epoch's last batch ran)."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    return loop is not None and bool(loop["epoch_loop.batch_progress"]["is_last_batch"])


def reopen_epoch_cut_short(checkpoint: dict[str, Any]) -> None:
    """Mark the loaded checkpoint's epoch unfinished if it ended before its last batch (in place, before Lightning
    restores its loops from it), the form Lightning gives a checkpoint taken inside an epoch: the fit continues it."""
    if epoch_cut_short(checkpoint) is None:
        return
    epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for tracker in (epochs["current"], epochs["total"]):
        tracker["processed"] -= 1
        tracker["completed"] = tracker["processed"]
    checkpoint["epoch"] = epochs["current"]["completed"]


def training_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit's training loaders (none before they are set up)."""
    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def training_loader_mode(trainer: pl.Trainer) -> str:
    """The mode of the fit's ``CombinedLoader`` (Lightning wraps a single training loader, or a dict or list of them,
    in one of mode ``max_size_cycle``); set once the fit's training loaders are."""
    combined = trainer.fit_loop._combined_loader
    assert combined is not None
    return combined._mode


def start_the_next_epoch(trainer: pl.Trainer) -> None:
    """A fit limited by ``max_steps`` that resumes from a checkpoint taken at an epoch's end: Lightning takes it as a
    restart inside that epoch, which runs one batch past the epoch's end from a new loader (under DDPStrategy too),
    where a fit limited by epochs starts the next epoch. Make it start the next epoch (before the fit loop runs)."""
    fit_loop = trainer.fit_loop
    epochs = fit_loop.epoch_progress.current
    ended = epochs.ready == epochs.started == epochs.processed
    if trainer.max_steps != -1 and fit_loop.restarting and ended:
        _Loop.restarting.fset(fit_loop, False)  # the loops' own setter: the epoch-limited fit's state (children too)


def resumed_mid_epoch(trainer: pl.Trainer) -> tuple[int, int] | None:
    """``(epoch, batches done)`` where this fit resumes inside an epoch (from a restored checkpoint), else ``None``.
    Readable before the fit loop runs: Lightning's restart stage is worked out from the restored progress."""
    fit_loop = trainer.fit_loop
    fit_loop.update_restart_stage()
    if not fit_loop.restarted_mid_epoch:
        return None
    return fit_loop.epoch_progress.current.processed, fit_loop.epoch_loop.batch_progress.current.ready


def align_resumed_batch_count(trainer: pl.Trainer) -> None:
    """Set the resumed epoch's batch count to where its training loader resumes (at the start of a resumed fit).

    Raises:
        ResumeRefusedError: several training loaders resume at different batches.
    """
    epoch = trainer.fit_loop.epoch_progress.current.processed
    counts = {
        count
        for loader in training_loaders(trainer)
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


def training_position(trainer: pl.Trainer) -> dict[str, Any]:
    """Where training stands during an optimizer step, as :func:`continue_after` takes it on another node of the same
    job: the epoch, the batches of the epoch and of the fit (this one counted), the training loaders' positions, the
    learning-rate schedulers' states (this step's update not yet applied)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return {
        "epoch": trainer.current_epoch,
        "epoch_batches": epoch_loop.batch_progress.current.ready,
        "batches": epoch_loop.batch_progress.total.ready,
        "batches_that_stepped": epoch_loop._batches_that_stepped,
        "loaders": [loader.state_dict() for loader in _resumable(trainer)],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }


def continue_after(trainer: pl.Trainer, position: dict[str, Any], optimizer_steps: int) -> None:
    """Set the loops, loaders and schedulers of a fit that has not started its first batch to where another node of
    the job stood during its optimizer step ``optimizer_steps``, as if this trainer had taken that step too. Call in
    ``on_train_start``, before :func:`align_resumed_batch_count`."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    for tracker in (fit_loop.epoch_progress.current, fit_loop.epoch_progress.total):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = position["epoch"]
    progress = epoch_loop.batch_progress
    for tracker, count in ((progress.current, position["epoch_batches"]), (progress.total, position["batches"])):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = count
    steps = (
        epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        if trainer.lightning_module.automatic_optimization
        else epoch_loop.manual_optimization.optim_step_progress.total
    )
    steps.ready = steps.completed = optimizer_steps
    for loader, state in zip(_resumable(trainer), position["loaders"], strict=True):
        loader.load_state_dict(state)
    for config, state in zip(trainer.lr_scheduler_configs, position["schedulers"], strict=True):
        config.scheduler.load_state_dict(state)
    # The schedulers' update at the end of that step, as Lightning makes it (its count is the one before the step).
    epoch_loop._batches_that_stepped = position["batches_that_stepped"]
    epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=False)
    if position["epoch_batches"] == trainer.num_training_batches:
        epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)
    # The epoch continues as after a checkpoint written at that batch's end: Lightning keeps the counts set above
    # and counts the batch as stepped. Where a checkpoint given to this fit was restored, its restart stages would
    # move the counts again: this position replaces it.
    fit_loop.reset_restart_stage()
    epoch_loop.reset_restart_stage()
    epoch_loop.restarting = True


def _resumable(trainer: pl.Trainer) -> list[ResumableDataLoader]:
    return [loader for loader in training_loaders(trainer) if isinstance(loader, ResumableDataLoader)]
