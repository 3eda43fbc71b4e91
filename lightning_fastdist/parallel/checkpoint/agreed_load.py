"""Which checkpoint a job resumes from, agreed by every rank: a read error on one rank only (an NFS hiccup after a
requeue) made that rank fall back to an older checkpoint alone, and the ranks resumed from different steps.

Every rank tries rank 0's candidates in rank 0's order (its folder listing: another node's may differ), and the ranks
tell each other how each candidate went; they take the first that loaded, and was not refused, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError, describe_unloadable

# What a failed load can raise: torch.distributed.checkpoint's error is a BaseException.
_LOAD_ERRORS = (Exception, CheckpointException)


def _in_a_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank_zeros(value: Any) -> Any:
    """Rank 0's ``value``, on every rank."""
    if not _in_a_group():
        return value
    carried = [value]
    dist.broadcast_object_list(carried, src=0)
    return carried[0]


def _every_ranks(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank."""
    if not _in_a_group():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _try(
    load: Callable[[Path], Any], candidate: Path, expects_folder: bool | None, refuse: Callable[[Any, Path], str | None]
) -> tuple[Any, str | None]:
    """``candidate`` loaded on this rank, or the one line saying why it cannot be resumed from."""
    try:
        checkpoint = load(candidate)
    except _LOAD_ERRORS as error:
        return None, describe_unloadable(candidate, error, expects_folder)
    return checkpoint, refuse(checkpoint, candidate)


def _one_line(failed: list[tuple[int, str]], ranks: int) -> str:
    """The first failing rank's line, saying which ranks failed where not all did."""
    rank, line = failed[0]
    if len(failed) == ranks:
        return line
    which = ", ".join(str(r) for r, _ in failed)
    return f"{line.removesuffix('.')} (on rank {which} of {ranks}; the others read it)."


def load_on_every_rank(
    candidates: Sequence[Path],
    load: Callable[[Path], Any],
    expects_folder: bool | None,
    refuse: Callable[[Any, Path], str | None] = lambda checkpoint, path: None,
) -> tuple[Any, Path, str | None]:
    """Every rank calls this: ``load`` the first of rank 0's ``candidates`` that loads on every rank.

    Args:
        candidates: the checkpoint asked for, then (where a fall-back is allowed) the others to try, newest first.
        load: loads one path on this rank (a collective for sharded checkpoints: every rank tries each candidate).
        expects_folder: as :func:`~.problems.describe_unloadable` takes it.
        refuse: the one line saying why a loaded checkpoint cannot be resumed from here, or ``None``.

    Returns:
        The checkpoint, the path it was loaded from, and the line saying why the first candidate was not taken (or
        ``None``).

    Raises:
        UnusableCheckpointError: on every rank alike, naming the first candidate's problem (and the rank).
    """
    ordered = [Path(candidate) for candidate in _rank_zeros([str(candidate) for candidate in candidates])]
    first_problem: str | None = None
    for candidate in ordered:
        checkpoint, problem = _try(load, candidate, expects_folder, refuse)
        lines = _every_ranks(problem)
        failed = [(rank, line) for rank, line in enumerate(lines) if line is not None]
        if not failed:
            return checkpoint, candidate, first_problem
        first_problem = first_problem or _one_line(failed, len(lines))
    if len(ordered) == 1:
        raise UnusableCheckpointError(first_problem)
    raise UnusableCheckpointError(f"{first_problem} No other checkpoint in '{ordered[0].parent}' loads either.")
