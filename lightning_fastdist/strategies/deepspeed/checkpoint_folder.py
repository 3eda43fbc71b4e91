"""FastDeepSpeedStrategy's checkpoint folder (DeepSpeed's ``latest``, ``zero_to_fp32.py`` and a tag folder of per-rank
states), written under ``<name>.partial`` and published by rank 0 once every rank's files are complete.

With ``async_checkpointing`` during a fit, DeepSpeed's engine saves as always but its state files are recorded instead
of written (:mod:`~lightning_fastdist.parallel.deepspeed.recorded_checkpoint`: why not DeepSpeed's own asynchronous
writers); the background save copies them into host memory and writes them with DeepSpeed's own writer. The engine
writes its small files into the staging folder in place, so a save waits for the one in flight before it starts (the
same step saved twice, ``save_last`` beside a top-k save, waits for the first).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_fastdist.parallel.checkpoint.atomic import publish, save_folder_atomically, stage_folder
from lightning_fastdist.parallel.checkpoint.background_save import Publication, SavePart
from lightning_fastdist.parallel.deepspeed.recorded_checkpoint import recording_files
from lightning_fastdist.strategies.checkpoint.saves import CheckpointSaves


def save_checkpoint_folder(saves: CheckpointSaves, engine: Any, write: Callable[[Path], None], path: Path) -> None:
    """Every rank: ``write(staging_folder)`` (Lightning's DeepSpeed save, through DeepSpeed's ``engine``), then the
    folder published at ``path``: now, or in the background (:meth:`~.saves.CheckpointSaves.in_background`).

    Raises:
        CheckpointSaveError: on every rank, a part of this save (or of the save in flight) failed.
    """
    saves.wait()  # DeepSpeed writes into <name>.partial now: no earlier save may still be writing there
    if not saves.in_background():
        save_folder_atomically(write, path)
        return
    with recording_files(engine) as recorded:
        staged = stage_folder(write, path)
    first = not dist.is_initialized() or dist.get_rank() == 0
    publication = Publication(lambda: publish(staged, path), staged) if first else None
    saves.background.save(path, [SavePart(recorded.files, recorded.write)], publication, in_background=True)
