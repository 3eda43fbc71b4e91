"""A distributed-checkpoint folder (``torch.distributed.checkpoint``: every rank its shards, rank 0 the index and small
files of its own) as one save's parts, for :class:`~.background_save.BackgroundSave`: written under ``<name>.partial``
and published by rank 0 once every rank's shards are complete (:mod:`.atomic`).

A checkpoint's shards are planned with ``torch.distributed.checkpoint``'s cached plans
(``DefaultSavePlanner(enable_plan_caching=True)``): from the second save of the same shards on, no rank sends its plan
to rank 0 and rank 0 builds no global plan (the planning round is most of what a save of small shards costs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_fastdist.parallel.checkpoint.atomic import publish, write_staged
from lightning_fastdist.parallel.checkpoint.background_save import BackgroundSave, Publication, SavePart
from lightning_fastdist.parallel.checkpoint.checkpoint_files import delete_checkpoint, staging_path
from lightning_fastdist.parallel.checkpoint.save_failure import agree_on_save, state_bytes


class CheckpointShardsPlanner(DefaultSavePlanner):
    """The planner of a checkpoint's shards, its plans cached: ``torch.distributed.checkpoint`` keeps them by planner
    class, so a class of its own keeps other sharded saves in the process (a node's own state) out of its cache."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def sharded_part(
    tensors: dict[str, Any],
    small_files: dict[str, Any],
    path: Path,
    group: dist.ProcessGroup | None,
    step: int | None = None,
    planner: type[DefaultSavePlanner] = DefaultSavePlanner,
) -> tuple[SavePart, Publication | None]:
    """This rank's part of saving ``tensors`` (a distributed-checkpoint state dict) as the folder ``path``, and on
    rank 0 its publication.

    Args:
        small_files: written by rank 0 beside the shards, each ``torch.save``d under its name (Lightning's metadata).
        group: the ranks that save together (``None``: the world).
        step: as for :func:`~.atomic.publish` (a checkpoint's global step; ``None`` for a side file's folder).
        planner: the class planning the shards (a checkpoint's: :class:`CheckpointShardsPlanner`).
    """
    path = Path(path)
    staged = staging_path(path)
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    expected_bytes = state_bytes(tensors) * ranks
    first = not dist.is_initialized() or dist.get_rank(group) == 0

    def prepare(files: dict[str, Any]) -> None:
        delete_checkpoint(staged)
        staged.mkdir(parents=True)
        for name, content in files.items():
            write_staged(lambda folder: torch.save(content, folder / name), staged, path, expected_bytes)

    def write(state: dict[str, Any]) -> None:
        failure = None
        if first:
            try:
                prepare(state["small_files"])
            except Exception as error:  # noqa: BLE001 - every rank raises it, through agree_on_save
                failure = error
        agree_on_save(failure, path, group)  # the folder is there, and empty of earlier shards, before any goes in

        def save_shards(folder: Path) -> None:
            dcp.save(state["tensors"], checkpoint_id=folder, process_group=group, planner=planner())

        write_staged(save_shards, staged, path, expected_bytes)

    publication = Publication(lambda: publish(staged, path, step), staged) if first else None
    return SavePart({"tensors": tensors, "small_files": small_files}, write), publication


def save_sharded_folder(tensors: dict[str, Any], small_files: dict[str, Any], path: Path) -> None:
    """Save ``tensors`` as the folder ``path`` now, every rank of the world (a node's own state beside a checkpoint).

    Raises:
        CheckpointSaveError: on every rank, where another rank's part failed; a full disk on the rank it filled.
    """
    part, publication = sharded_part(tensors, small_files, path, group=None)
    BackgroundSave().save(path, [part], publication, in_background=False)
