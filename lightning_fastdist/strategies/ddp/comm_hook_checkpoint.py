"""FastDDPStrategy's comm hook in checkpoints: ``comm_hook: auto``'s level and decisions, and PowerSGD's state, each
rank's error feedback in a file of its own, beside the checkpoint.

Error feedback differs per rank and is as large as the gradients, so it never travels to rank 0: the checkpoint
holds what every rank shares (step count, ``Q`` factors, world size) and each rank writes its error feedback to
``<checkpoint>.powersgd/stepSSSSSSSSS/rankNNNNN.pt`` (a part of the save, in the background with the rest under
``async_checkpointing``) before rank 0 publishes the checkpoint, which names that save's
folder: the files and the checkpoint are published together, the previous pair kept until then
(:mod:`~lightning_fastdist.parallel.checkpoint.side_saves`; resume pitfalls: ``docs/ddp.md``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_fastdist.parallel.checkpoint.atomic import is_local_path
from lightning_fastdist.parallel.checkpoint.background_save import SavePart
from lightning_fastdist.parallel.checkpoint.side_saves import POWERSGD_ERRORS
from lightning_fastdist.parallel.ddp.auto_comm_hook import AutoCommState
from lightning_fastdist.parallel.ddp.comm_hooks import HookState
from lightning_fastdist.parallel.ddp.powersgd import PowerSGDState
from lightning_fastdist.strategies.checkpoint.side_files import read_side_file, write_side_file

CHECKPOINT_KEY = "fast_ddp_comm_hook"  # PowerSGD's shared state, and where each rank's error feedback is
AUTO_CHECKPOINT_KEY = "fast_ddp_comm_hook_auto"  # the level auto chose, and its decisions
LOCATION_KEY = "loaded_from"  # set on load: where the checkpoint was read, so its shards can be found


@dataclass(frozen=True)
class RegisteredHook:
    """A comm hook as DDP runs it on this rank: its state, the strategy's ``comm_hook`` option (named where a
    checkpoint's state does not fit it), and where this rank stands."""

    state: HookState
    comm_hook: str
    world_size: int
    rank: int
    device: torch.device

    @property
    def powersgd_state(self) -> PowerSGDState | None:
        """PowerSGD's state: the hook's own, or the one ``auto`` keeps for its last level; ``None`` without one."""
        state = self.state.powersgd if isinstance(self.state, AutoCommState) else self.state
        return state if isinstance(state, PowerSGDState) else None

    @property
    def powersgd_name(self) -> str:
        """The hook a checkpoint's PowerSGD state is restored into (``auto`` runs PowerSGD at its last level)."""
        return "powersgd" if isinstance(self.state, AutoCommState) else self.comm_hook


class CommHookCheckpoint:
    """What a checkpoint holds of one strategy's comm hook: written beside and into each checkpoint, and put back into
    the hook once it is registered (a checkpoint loaded before DDP wraps the model waits for it)."""

    def __init__(self) -> None:
        self.hook: RegisteredHook | None = None
        self._pending: dict[str, Any] | None = None

    def attach(self, hook: RegisteredHook) -> None:
        """Once DDP registered the hook (every wrap): put back what a checkpoint loaded before held."""
        self.hook = hook
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def save(self, checkpoint: dict[str, Any], filepath: Any) -> list[SavePart]:
        """Put the hook's state into ``checkpoint``; return this rank's file of error feedback beside ``filepath``,
        to write as part of the save (every rank's is complete before the checkpoint is published)."""
        if self.hook is None:
            return []
        if isinstance(self.hook.state, AutoCommState):
            checkpoint[AUTO_CHECKPOINT_KEY] = self.hook.state.state_dict()
        powersgd_state = self.hook.powersgd_state
        if powersgd_state is None:
            return []
        checkpoint[CHECKPOINT_KEY], part = save_hook_state(
            powersgd_state, "powersgd", filepath, self.hook.world_size, self.hook.rank, checkpoint.get("global_step", 0)
        )
        return [part]

    @staticmethod
    def note_location(checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        """``checkpoint`` as loaded from ``checkpoint_path``: the ranks' PowerSGD files are found beside the file
        actually loaded (a fall-back may load another than the one asked for)."""
        if CHECKPOINT_KEY in checkpoint:
            checkpoint[CHECKPOINT_KEY] = remember_location(checkpoint[CHECKPOINT_KEY], checkpoint_path)
        return checkpoint

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Put a loaded checkpoint's hook state back into the hook, or keep it until the hook is registered."""
        saved = {key: checkpoint[key] for key in (CHECKPOINT_KEY, AUTO_CHECKPOINT_KEY) if key in checkpoint}
        if saved and self.hook is None:
            self._pending = saved
        elif saved:
            self._restore(saved)

    def _restore(self, saved: dict[str, Any]) -> None:
        hook = self.hook
        assert hook is not None
        if isinstance(hook.state, AutoCommState) and AUTO_CHECKPOINT_KEY in saved:
            hook.state.load_state_dict(saved[AUTO_CHECKPOINT_KEY])
            if hook.state.decisions:
                rank_zero_info(
                    f"comm_hook auto: resumed at {hook.state.level} (decided at step {hook.state.decisions[-1].step})."
                )
        if CHECKPOINT_KEY in saved:
            restore_hook_state(
                hook.powersgd_state, hook.powersgd_name, saved[CHECKPOINT_KEY], hook.world_size, hook.rank, hook.device
            )


def shard_path(checkpoint_path: Any, step: int, rank: int, follow_link: bool = False) -> str:
    """Where ``rank``'s error feedback of the save at global step ``step`` of a checkpoint lives: a load follows a
    link (``last.ckpt`` under Lightning's ``save_last="link"``) to the checkpoint it names, whose files are beside
    it."""
    path = str(checkpoint_path)
    if follow_link and is_local_path(path):
        path = str(Path(path).resolve())
    return f"{POWERSGD_ERRORS.save_folder(path, step)}/rank{rank:05d}.pt"


def save_hook_state(
    hook_state: PowerSGDState, comm_hook: str, checkpoint_path: Any, world_size: int, rank: int, step: int
) -> tuple[dict[str, Any], SavePart]:
    """What the checkpoint itself holds of the hook (naming the save at global step ``step``), and this rank's part
    of that save: its error feedback, written beside ``checkpoint_path`` in the folder of that save."""
    state = hook_state.state_dict()
    shard = {"rank": rank, "world_size": world_size, "iteration": state["iteration"], "errors": state["errors"]}
    path = shard_path(checkpoint_path, step, rank)
    shared = {
        "comm_hook": comm_hook,
        "world_size": world_size,
        "iteration": state["iteration"],
        "q_memory": state["q_memory"],
        "errors_of_step": step,
    }
    return shared, SavePart(shard, lambda copy: write_side_file(copy, path))


def remember_location(saved: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
    """``saved`` with the path it was loaded from, to find its shards later."""
    return {**saved, LOCATION_KEY: str(checkpoint_path)}


def restore_hook_state(
    hook_state: PowerSGDState | None, comm_hook: str, saved: dict, world_size: int, rank: int, device: torch.device
) -> None:
    """Load the part of a checkpoint's hook state that belongs to this rank into ``hook_state``.

    Args:
        comm_hook: the strategy's ``comm_hook`` option (named in the warning when it ignores the state).
        saved: what :func:`save_hook_state` and :func:`remember_location` left.
    """
    if hook_state is None or saved["comm_hook"] != "powersgd":
        rank_zero_warn(f"The checkpoint holds {saved['comm_hook']!r} hook state; comm_hook={comm_hook!r} ignores it.")
        return
    saved_by = saved["world_size"]
    errors = _read_own_errors(saved, rank) if saved_by == world_size else None
    if saved_by != world_size:
        rank_zero_warn(
            f"PowerSGD state was saved by {saved_by} ranks and is resumed by {world_size}: "
            "keeping the step count and Q factors, restarting error feedback from zero."
        )
    hook_state.load_state_dict(
        {"iteration": saved["iteration"], "q_memory": saved["q_memory"], "errors": errors or {}}, device
    )


def _read_own_errors(saved: dict, rank: int) -> dict | None:
    """This rank's error feedback from its file beside the checkpoint, or ``None`` (with one line) if unusable."""
    if LOCATION_KEY not in saved:
        warnings.warn(f"[rank {rank}] PowerSGD error feedback: the checkpoint's location is unknown; restarting it.")
        return None
    path = shard_path(saved[LOCATION_KEY], saved["errors_of_step"], rank, follow_link=True)
    try:
        shard = read_side_file(path)
    except (OSError, RuntimeError, EOFError) as error:
        problem = f"cannot be read ({type(error).__name__})"
    else:
        if shard.get("iteration") == saved["iteration"] and shard.get("rank") == rank:
            return shard["errors"]
        problem = f"belongs to another save (step count {shard.get('iteration')}, not {saved['iteration']})"
    warnings.warn(f"[rank {rank}] PowerSGD error feedback at {path} {problem}: restarting it from zero on this rank.")
    return None


def remove_shards(checkpoint_path: Any) -> None:
    """Remove the ranks' files of every save of ``checkpoint_path``, then the folders holding them if empty.

    Only ``rankNNNNN.pt`` files are touched: anything else stays, and so does its folder.
    """
    POWERSGD_ERRORS.remove(checkpoint_path)
