"""What a strategy adds to checkpoints so that a resumed run continues bit for bit, leaving the run that saved as it
would have been without saving, and Lightning's own state as Lightning wrote it.

Lightning saves weights, optimizer, schedulers, loop progress and the training loader's position. :class:`ResumeState`
adds every rank's random states at the save, and the resumed run sets them back at the same point of its data: before
the next epoch's loader starts (a checkpoint at an epoch's end: the loader draws its workers' seed, and a shuffled
order, from the global generator as it starts) or before the next batch (inside an epoch, the loader already running).
A plain loader resumed inside an epoch continues where it stopped (``data/plain_resume.py``).

An epoch that ``max_steps`` cut short is written as Lightning marks it (finished: Lightning's strategies resume our
file as they resume their own, with the next epoch), and beside it, under our own key, whether our resume continues it:
our load reopens it in the loaded state, before Lightning restores its loops from that state.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fastdist.data.plain_resume import cut_short_line, is_stateful, order_is_reproducible
from lightning_fastdist.strategies.checkpoint.rng_states import collect_rng_states, set_rng_states
from lightning_fastdist.trainer.loop_state import ends_an_epoch, epoch_cut_short, reopen_epoch_cut_short

RNG_KEY = "fastdist_rng_states"  # a list with one entry per rank
RESTORE_AT_KEY = "fastdist_rng_restore_at"  # EPOCH_START or NEXT_BATCH (missing in older checkpoints: NEXT_BATCH)
CUT_SHORT_KEY = "fastdist_epoch_cut_short"  # [epoch, batches run, batches in the epoch]: a resume goes on after it
REOPEN_KEY = "fastdist_reopen_epoch_cut_short"  # True: our resume continues the epoch max_steps cut short
EPOCH_START, NEXT_BATCH = "epoch_start", "next_batch"


class ResumeState:
    """This rank's random states of a loaded checkpoint, until the point of the data where they apply."""

    def __init__(self) -> None:
        self._rng: dict[str, Any] | None = None
        self._restore_at = NEXT_BATCH

    def add_to(
        self, checkpoint: dict[str, Any], rank: int, world_size: int, loaders: list[Any], epoch_batches: float
    ) -> None:
        """Put the resume state into ``checkpoint``; call on every rank (it gathers), before writing.

        Args:
            loaders: the fit's training loaders: an epoch a ``max_steps`` stop cut short is continued by our resume
                where they can continue it, else it stays finished, as Lightning marks it.
            epoch_batches: the training batches of an epoch (``trainer.num_training_batches``).
        """
        if "loops" not in checkpoint:  # a weights-only checkpoint
            return
        cut = epoch_cut_short(checkpoint)
        if cut is not None and loaders and all(_continues(loader) for loader in loaders):
            checkpoint[REOPEN_KEY] = True
        elif cut is not None:
            checkpoint[CUT_SHORT_KEY] = [*cut, epoch_batches]
        checkpoint[RNG_KEY] = _gather_to_rank_zero(collect_rng_states(), world_size, rank)
        continues_inside_the_epoch = not ends_an_epoch(checkpoint) and CUT_SHORT_KEY not in checkpoint
        checkpoint[RESTORE_AT_KEY] = NEXT_BATCH if continues_inside_the_epoch else EPOCH_START

    def take_from(self, checkpoint: dict[str, Any], rank: int, world_size: int, fitting: bool) -> None:
        """Keep this rank's random states from a loaded ``checkpoint`` for the point of the data where they apply; a
        fit that resumes after an epoch cut short continues it (reopened in ``checkpoint``, which Lightning then
        restores its loops from) where its loaders could, else says what it skips."""
        if fitting and checkpoint.get(REOPEN_KEY):
            reopen_epoch_cut_short(checkpoint)
        if fitting and checkpoint.get(CUT_SHORT_KEY) is not None:
            rank_zero_warn(cut_short_line(*checkpoint[CUT_SHORT_KEY]))
        per_rank = checkpoint.get(RNG_KEY)
        if per_rank is None:
            return
        if len(per_rank) != world_size:
            rank_zero_warn(
                f"This checkpoint was written by {_ranks(len(per_rank))} and is resumed by {_ranks(world_size)}: "
                "the run continues at the next sample but not bit for bit (random draws such as dropout follow this "
                "run's seed, and each step's gradient is summed over another split of the batch)."
            )
        self._rng = per_rank[rank] if len(per_rank) == world_size else None
        self._restore_at = checkpoint.get(RESTORE_AT_KEY) or NEXT_BATCH

    def before_training_data(self) -> None:
        """Set the kept random states where the checkpoint ended an epoch: call as the fit's training loaders are set
        up, before Lightning starts them."""
        if self._restore_at == EPOCH_START:
            self.before_batch()

    def before_batch(self) -> None:
        """Set the kept random states, once: call first in ``on_train_batch_start``."""
        if self._rng is not None:
            set_rng_states(self._rng)
            self._rng = None


def _continues(loader: Any) -> bool:
    """Whether a resume can continue ``loader`` inside an epoch, exactly (a stateful loader: Lightning restores it)."""
    return is_stateful(loader) or order_is_reproducible(loader)


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"


def _gather_to_rank_zero(state: dict, world_size: int, rank: int) -> list[dict] | None:
    """Every rank's ``state`` as a list on rank 0 (``None`` elsewhere); a collective on all ranks."""
    if not (dist.is_available() and dist.is_initialized()) or world_size == 1:
        return [state]
    gathered: list[dict] | None = [{} for _ in range(world_size)] if rank == 0 else None
    dist.gather_object(state, gathered, dst=0)
    return gathered
