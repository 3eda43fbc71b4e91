"""What every strategy of this package does so that a checkpoint is never half written, garbage, or a dead end:
a non-finite state is refused before anything is written, one run writes a checkpoint folder at a time (what failed
saves left there goes at its first save), a failure on one rank fails the save on every rank in one line (the writes
themselves: :mod:`.saves`), and the ranks resume from a checkpoint they all load (a ``last*.ckpt`` that does not
load, or cannot resume this run, falls back to the newest that does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fastdist.parallel.checkpoint.agreed_load import load_on_every_rank
from lightning_fastdist.parallel.checkpoint.atomic import is_local_path
from lightning_fastdist.parallel.checkpoint.folder_lock import hold_folder
from lightning_fastdist.parallel.checkpoint.leftovers import remove_leftovers
from lightning_fastdist.parallel.checkpoint.save_failure import agree_on_save
from lightning_fastdist.parallel.faults.finite_state import non_finite_entry

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIX = ModelCheckpoint.FILE_EXTENSION
TRAINING_STATE_KEYS = ("state_dict", "optimizer_states")  # the checkpoint entries that must be finite


class NonFiniteCheckpointError(RuntimeError):
    """A checkpoint was refused because the state to be saved holds NaN or inf."""


def refuse_non_finite(strategy: Strategy, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Collective: raise :class:`NonFiniteCheckpointError` on every rank if any rank's state holds NaN/inf.

    A DTensor is tested by its own rank's shard. Only the weights and the optimizer state are tested: callbacks keep
    infinities on purpose (a best score so far).
    """
    entry = non_finite_entry({key: checkpoint[key] for key in TRAINING_STATE_KEYS if key in checkpoint})
    if not strategy.reduce_boolean_decision(entry is not None, all=False):
        return
    raise NonFiniteCheckpointError(
        f"refusing to save '{filepath}' at step {checkpoint.get('global_step', '?')}: "
        f"{entry or 'the state of another rank'} holds NaN or inf. The checkpoints saved before are kept; "
        "resume from them, and add NonFiniteLoss(action='skip') to skip steps whose loss is not finite."
    )


def claim_checkpoint_folder(
    strategy: Strategy, checkpoint: dict[str, Any], filepath: Any, trainer: pl.Trainer | None
) -> None:
    """Collective, before anything of a save is written: rank 0 of this process's world takes the folder of
    ``filepath`` for its node (:mod:`~lightning_fastdist.parallel.checkpoint.folder_lock`; held until the fit of
    ``trainer`` ends, only checked for a save outside a running fit), and the first time node 0 takes it, removes what
    failed saves left there. Raises :class:`~lightning_fastdist.parallel.checkpoint.save_failure.CheckpointSaveError`
    on every rank where another live run holds it."""
    if not is_local_path(filepath):
        return
    failure = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        fitting = fitting and trainer.state.status == TrainerStatus.RUNNING
        try:
            _claim(strategy.node_rank, checkpoint, Path(filepath).parent, fitting)
        except Exception as error:  # noqa: BLE001 - every rank raises it, through agree_on_save
            failure = error
    agree_on_save(failure, Path(filepath))


def _claim(node: int, checkpoint: dict[str, Any], folder: Path, fitting: bool) -> None:
    """Rank 0's part: leftovers are removed by node 0 alone, which publishes the checkpoint (another node's first
    save may come while node 0 stages one), and only when it newly takes the folder (no save of its own under way)."""
    if not hold_folder(folder, node, keep=fitting) or node != 0:
        return
    removed = remove_leftovers(folder, checkpoint.get("global_step", 0))
    if removed:
        log.info(f"removed what failed saves left in {folder}: {', '.join(removed)}")


def load_or_fall_back(
    strategy: Strategy, path: Any, load: Callable[[Any], dict[str, Any]], expects_folder: bool | None
) -> tuple[dict[str, Any], Any]:
    """``load(path)`` on every rank, where every rank loads it and it can resume this run; else one line naming the
    file, or for a ``last`` checkpoint the newest of its folder that every rank loads (the trainer then resumes from
    that one). Rank 0 names the candidates: every rank resumes from the same checkpoint.

    Args:
        strategy: the strategy loading, for the trainer whose checkpoint path a fall-back replaces.
        path: the checkpoint Lightning resolved (``"last"`` already resolved to a file).
        load: loads one path on every rank (a collective for sharded checkpoints).

    Returns:
        The checkpoint and the path it was loaded from.

    Raises:
        UnusableCheckpointError: neither ``path`` nor (for ``last``) any other checkpoint of its folder loads.
    """
    strategy.shared.saves.wait()  # a save in flight is published first: it may be the one to load
    requested = Path(path)
    lists_folder = is_last_checkpoint(requested) and (not dist.is_initialized() or dist.get_rank() == 0)
    candidates = [requested, *_older_checkpoints(requested)] if lists_folder else [requested]  # rank 0's are taken
    trainer = strategy.lightning_module._trainer
    across_nodes = strategy.shared.across_nodes

    def refuse(checkpoint: dict[str, Any], candidate: Path) -> str | None:
        return across_nodes.resume_refusal(checkpoint, candidate, trainer)

    checkpoint, loaded, problem = load_on_every_rank(candidates, load, expects_folder, refuse)
    if problem is not None:
        rank_zero_warn(f"{problem} Resuming from '{loaded}' instead, the newest checkpoint there that loads.")
    if loaded != requested and trainer is not None:
        trainer._checkpoint_connector._ckpt_path = str(loaded)
    return checkpoint, loaded


def is_last_checkpoint(path: Path) -> bool:
    """Whether ``path`` is named like ``ModelCheckpoint``'s ``last`` checkpoints (what ``ckpt_path="last"`` finds)."""
    return path.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) and path.suffix == CHECKPOINT_SUFFIX


def _older_checkpoints(failed: Path) -> list[Path]:
    """The other checkpoints (files or sharded folders) in ``failed``'s folder, newest first."""
    # A save in progress ("last.ckpt.partial") has another suffix and is never a candidate.
    others = [entry for entry in failed.parent.iterdir() if entry.suffix == CHECKPOINT_SUFFIX and entry != failed]
    return sorted(others, key=lambda entry: entry.stat().st_mtime, reverse=True)
