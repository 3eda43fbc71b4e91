"""What every strategy of this package does so that a checkpoint is never half written, garbage, or a dead end:
a non-finite state is refused before anything is written, a file is staged and renamed once complete, and an
unusable checkpoint ends in one line naming it (a ``last*.ckpt`` that does not load falls back to the newest that does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fastdist.parallel.checkpoint.atomic import check_save_target, save_file_atomically
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError, describe_unloadable
from lightning_fastdist.parallel.faults.finite_state import non_finite_entry

CHECKPOINT_SUFFIX = ModelCheckpoint.FILE_EXTENSION
TRAINING_STATE_KEYS = ("state_dict", "optimizer_states")  # the checkpoint entries that must be finite
# What a failed load can raise: torch.distributed.checkpoint's error is a BaseException.
_LOAD_ERRORS = (Exception, CheckpointException)


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


def save_one_file(
    strategy: Strategy,
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any = None,
    writer: bool | None = None,
) -> None:
    """The ``writer`` rank (``None``: global rank 0) writes ``checkpoint`` with the strategy's ``checkpoint_io`` under
    ``<name>.partial``, renamed onto ``<name>`` once complete.

    Every rank first refuses a folder at ``filepath`` that is not a checkpoint, so all ranks stop alike.
    """
    check_save_target(Path(filepath), sharded=False)
    if strategy.is_global_zero if writer is None else writer:
        save_file_atomically(
            lambda staged: strategy.checkpoint_io.save_checkpoint(checkpoint, staged, storage_options), Path(filepath)
        )


def load_or_fall_back(
    strategy: Strategy, path: Any, load: Callable[[Any], dict[str, Any]], expects_folder: bool | None
) -> dict[str, Any]:
    """``load(path)``; if it fails, one line naming the file, or for a ``last`` checkpoint the newest that loads
    (the trainer then resumes from that one).

    Args:
        strategy: the strategy loading, for the trainer whose checkpoint path a fall-back replaces.
        path: the checkpoint Lightning resolved (``"last"`` already resolved to a file).
        load: loads one path on every rank (a collective for sharded checkpoints).

    Raises:
        UnusableCheckpointError: neither ``path`` nor (for ``last``) any other checkpoint of its folder loads.
    """
    try:
        return load(path)
    except _LOAD_ERRORS as error:
        problem = describe_unloadable(path, error, expects_folder)
    if not is_last_checkpoint(Path(path)):
        raise UnusableCheckpointError(problem) from None
    for candidate in _older_checkpoints(Path(path)):
        try:
            checkpoint = load(candidate)
        except _LOAD_ERRORS:
            continue
        rank_zero_warn(f"{problem} Resuming from '{candidate}' instead, the newest checkpoint there that loads.")
        assert strategy.lightning_module is not None
        strategy.lightning_module.trainer._checkpoint_connector._ckpt_path = str(candidate)
        return checkpoint
    raise UnusableCheckpointError(f"{problem} No other checkpoint in '{Path(path).parent}' loads either.") from None


def is_last_checkpoint(path: Path) -> bool:
    """Whether ``path`` is named like ``ModelCheckpoint``'s ``last`` checkpoints (what ``ckpt_path="last"`` finds)."""
    return path.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) and path.suffix == CHECKPOINT_SUFFIX


def _older_checkpoints(failed: Path) -> list[Path]:
    """The other checkpoints (files or sharded folders) in ``failed``'s folder, newest first."""
    # A save in progress ("last.ckpt.partial") has another suffix and is never a candidate.
    others = [entry for entry in failed.parent.iterdir() if entry.suffix == CHECKPOINT_SUFFIX and entry != failed]
    return sorted(others, key=lambda entry: entry.stat().st_mtime, reverse=True)
