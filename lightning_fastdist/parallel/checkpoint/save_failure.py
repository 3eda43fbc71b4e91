"""A save that fails on one rank fails on every rank, in one line: a full disk names the path and the bytes needed.

Each rank of a save writes its own part (rank 0 the file, every rank its shards or side files) and then waits for the
others; a rank whose write raised used to leave the others waiting at that barrier until the collective timeout, and
a full disk was a raw ``OSError`` on that rank only. Here the ranks exchange how their part went instead of waiting
blindly, and every rank raises: the failing rank its own error, the others :class:`CheckpointSaveError` naming it.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fastdist.parallel.checkpoint.checkpoint_files import size_on_disk

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
LITTLE_ROOM_BYTES = 1 << 20  # free on a disk where a write just failed: it failed for want of room


SAVE_ERRORS = (Exception, CheckpointException)  # what a rank's part of a save may raise (DCP's is a BaseException)


def failure_of(part: Callable[[], Any]) -> BaseException | None:
    """Run this rank's ``part`` of a save; what it raised, for :func:`agree_on_save`."""
    try:
        part()
    except SAVE_ERRORS as error:
        return error
    return None


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (on this rank or another); the message is one line naming the path and the cause. The
    checkpoints saved before it are kept."""


def is_disk_full(error: BaseException, folder: Path | None = None) -> bool:
    """Whether ``error`` says the disk (or the user's quota) is full; for ``torch.distributed.checkpoint``'s error,
    whether any rank's write said so. ``torch.save`` reports a write the full disk cut short as its zip writer's
    ``RuntimeError`` ("unexpected pos"), not as the ``OSError``: a write that failed in ``folder`` while less than
    ``LITTLE_ROOM_BYTES`` are free there is a full disk too (found by the fault campaign)."""
    if isinstance(error, CheckpointException):
        return any(is_disk_full(cause, folder) for cause, _ in error.failures.values())
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        return True
    return folder is not None and folder.exists() and shutil.disk_usage(folder).free < LITTLE_ROOM_BYTES


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (nested dicts, lists and tuples; a DTensor by this rank's shard): about
    what writing it takes on disk."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, Sequence) and not isinstance(state, str | bytes):
        return sum(state_bytes(value) for value in state)
    return 0


def disk_full_error(path: Path, staged: Path, expected_bytes: int | None) -> CheckpointSaveError:
    """The one line for a save of ``path`` that filled its disk while writing ``staged`` (call before removing it).

    The bytes needed, the most of what is known: the checkpoint the save replaces (the same model), what the state
    holds (``expected_bytes``), what was written before the disk filled (only that: "at least").
    """
    previous = size_on_disk(path)
    needed = max(previous, expected_bytes or 0, size_on_disk(staged))
    about = "about" if previous or expected_bytes else "at least"
    folder = path.parent if path.parent.exists() else Path.cwd()
    free = shutil.disk_usage(folder).free
    return CheckpointSaveError(
        f"cannot save checkpoint '{path}': the disk holding it is full (No space left on device); the save needs "
        f"{about} {needed:,} bytes and {free:,} bytes are free there. The checkpoints saved before are kept and the "
        "partial save was removed: free space or save elsewhere, then resume with --ckpt_path last."
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def agree_on_save(failure: BaseException | None, path: Path, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` calls this once its part of the save of ``path`` is done (``failure``: what it raised,
    or ``None``); a barrier that also raises on every rank when any part failed: the failing rank its own error, the
    others :class:`CheckpointSaveError` naming the first failing rank and its line. One process: raises ``failure``."""
    lines: list[str | None] = [None if failure is None else _first_line(failure)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        lines = [None] * dist.get_world_size(group)
        dist.all_gather_object(lines, None if failure is None else _first_line(failure), group=group)
    if failure is not None:
        raise failure
    failed = [(rank, line) for rank, line in enumerate(lines) if line is not None]
    if failed:
        rank, line = failed[0]
        if line.startswith(CheckpointSaveError.__name__ + ": "):  # already one line naming the path
            raise CheckpointSaveError(f"{line.removeprefix(CheckpointSaveError.__name__ + ': ')} (on rank {rank})")
        raise CheckpointSaveError(f"cannot save checkpoint '{path}': rank {rank} failed writing its part ({line}).")
