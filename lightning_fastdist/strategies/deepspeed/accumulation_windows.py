"""Where a gradient accumulation window closes under DeepSpeed: where Lightning closes it under DDP.

Lightning closes a window after ``accumulate_grad_batches`` batches of an epoch, and at the epoch's last batch, whatever
the count. DeepSpeed's engine decides from its own micro-step count instead, and Lightning lets it accumulate over the
epoch's end (``handles_gradient_accumulation``): an epoch of 10 batches with ``accumulate_grad_batches=3`` stepped after
its batches 3, 6, 9 and then after batch 2 of the next epoch, carrying the short window's gradient into it. The engine
is told each micro-batch's boundary before its forward and backward (DeepSpeed's
``set_gradient_accumulation_boundary``), and Lightning counts the epoch's last step as it does for DDP.
"""

from __future__ import annotations

import lightning.pytorch as pl


def epoch_ends_at_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being trained is its epoch's last (Lightning's own test: the epoch's batch count reached, or
    the loader said so for a loader without a length)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready == trainer.num_training_batches


def window_closes_at_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being trained closes its accumulation window: its ``accumulate_grad_batches``-th batch of the
    epoch, or the epoch's last."""
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    return ready % trainer.accumulate_grad_batches == 0 or epoch_ends_at_this_batch(trainer)
