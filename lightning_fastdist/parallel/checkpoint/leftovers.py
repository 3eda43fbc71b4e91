"""What failed saves left in a checkpoint folder, removed when a run first saves there again: a staged
``<name>.partial`` (a full disk stayed full after the resume), the previous copy a publish set aside
(``<stem>.replaced<suffix>``) once the checkpoint it stood in for is back, and the side files of a save whose checkpoint
was never published.

Only what a save of ours writes is touched (:func:`~.checkpoint_files.looks_like_our_save`): a ``.partial`` of
anything else stays. A set-aside copy whose checkpoint is missing is the complete one a crash between two renames left
(``ckpt_path="last"`` resumes from it): it stays.
"""

from __future__ import annotations

from pathlib import Path

from lightning_fastdist.parallel.checkpoint.checkpoint_files import (
    STAGING_SUFFIX,
    delete_checkpoint,
    exists,
    looks_like_our_save,
    replaced_original,
    replaced_path,
)
from lightning_fastdist.parallel.checkpoint.side_saves import SIDE_FILES


def remove_leftovers(folder: Path, step: int) -> list[str]:
    """Remove what failed saves left in ``folder``; return the names removed. Call where no other save of this run
    is in progress there (its first save in the folder), before the save at global step ``step`` is staged: side files
    of that step may be in progress on other nodes, and stay."""
    if not folder.is_dir():
        return []
    removed = []
    for entry in sorted(folder.iterdir()):
        if _is_leftover(entry) and looks_like_our_save(entry):
            try:
                delete_checkpoint(entry)
            except FileExistsError:  # not ours alone after all: left in place
                continue
            removed.append(entry.name)
    for kind in SIDE_FILES:
        for root in folder.glob(f"*{kind.suffix}"):
            checkpoint = root.with_name(root.name.removesuffix(kind.suffix))
            if not (exists(checkpoint) or exists(replaced_path(checkpoint))):
                kind.remove(checkpoint, older_than=step)
                if not exists(root):
                    removed.append(root.name)
    return removed


def _is_leftover(entry: Path) -> bool:
    """A staged save, or a set-aside copy whose checkpoint is back."""
    if entry.name.endswith(STAGING_SUFFIX):
        return True
    original = replaced_original(entry)
    return original is not None and exists(original)
