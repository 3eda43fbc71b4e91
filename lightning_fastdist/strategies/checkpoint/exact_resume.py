"""What a strategy adds to checkpoints so that a resumed run continues bit for bit.

Lightning saves weights, optimizer, schedulers, loop progress and the training loader's position. :class:`ResumeState`
adds every rank's random states, set back at the first training batch after a save or load (in both runs, so draws
between the save and that batch, which differ between the runs, do not matter), and fixes the loop progress.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fastdist.strategies.checkpoint.comm_hook_checkpoint import gather_to_rank_zero
from lightning_fastdist.strategies.checkpoint.rng_states import collect_rng_states, set_rng_states
from lightning_fastdist.trainer.loop_state import reopen_epoch_cut_short

RNG_KEY = "fastdist_rng_states"  # a list with one entry per rank


class ResumeState:
    """This rank's random states for the first training batch after a checkpoint was saved or loaded."""

    def __init__(self) -> None:
        self._rng_for_next_batch: dict[str, Any] | None = None

    def add_to(self, checkpoint: dict[str, Any], rank: int, world_size: int) -> None:
        """Put the resume state into ``checkpoint``; call on every rank (it gathers), before writing."""
        if "loops" not in checkpoint:  # a weights-only checkpoint
            return
        reopen_epoch_cut_short(checkpoint)
        self._rng_for_next_batch = collect_rng_states()
        checkpoint[RNG_KEY] = gather_to_rank_zero(self._rng_for_next_batch, world_size, rank)

    def take_from(self, checkpoint: dict[str, Any], rank: int, world_size: int) -> None:
        """Keep this rank's random states from a loaded ``checkpoint`` for the next training batch."""
        per_rank = checkpoint.get(RNG_KEY)
        if per_rank is None:
            return
        if len(per_rank) != world_size:
            rank_zero_warn(
                f"This checkpoint was written by {_ranks(len(per_rank))} and is resumed by {_ranks(world_size)}: "
                "the run continues at the next sample but not bit for bit (random draws such as dropout follow this "
                "run's seed, and each step's gradient is summed over another split of the batch)."
            )
        self._rng_for_next_batch = per_rank[rank] if len(per_rank) == world_size else None

    def before_batch(self) -> None:
        """Set the kept random states, once: call first in ``on_train_batch_start``."""
        if self._rng_for_next_batch is not None:
            set_rng_states(self._rng_for_next_batch)
            self._rng_for_next_batch = None


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"
