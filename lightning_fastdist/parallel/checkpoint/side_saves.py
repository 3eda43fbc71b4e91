"""Files a save writes beside its checkpoint (each rank's PowerSGD error feedback, each node's own state under
``outer_sync``), kept in a folder of that save's own: ``<checkpoint><suffix>/step<global step>/``.

Written in place, such files used to replace the previous save's before the checkpoint naming them was published: a
kill or a full disk in between left a pair that did not resume, and the previous consistent pair already overwritten.
Now the checkpoint names its save (by its step), so its one atomic publish switches to the new files; the previous
checkpoint's stay until then, and go once a newer checkpoint of that name is published (:func:`retire_older_saves`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import fsspec

_SAVE_FOLDER = re.compile(r"step(\d{9})")


@dataclass(frozen=True)
class SideFiles:
    """One kind of file written beside checkpoints.

    Attributes:
        suffix: what the folder beside a checkpoint is named after it (``last.ckpt`` -> ``last.ckpt.powersgd``).
        entry: the names of this kind's files or folders (and of their staging copies) in a save's folder: the only
            ones ever removed; anything else there stays, and keeps its folder.
    """

    suffix: str
    entry: re.Pattern[str]

    def root(self, checkpoint_path: object) -> str:
        """The folder beside ``checkpoint_path`` holding this kind's files of each of its saves."""
        return f"{checkpoint_path}{self.suffix}"

    def save_folder(self, checkpoint_path: object, step: int) -> str:
        """The folder of the save of ``checkpoint_path`` at global step ``step``."""
        return f"{self.root(checkpoint_path)}/step{step:09d}"

    def remove(self, checkpoint_path: object, older_than: int | None = None) -> None:
        """Remove this kind's files of the saves of ``checkpoint_path`` (of those before step ``older_than`` only: a
        later save may be in progress on another node), then each emptied folder."""
        fs, root = fsspec.core.url_to_fs(self.root(checkpoint_path))
        if not fs.isdir(root):
            return
        for folder in fs.ls(root, detail=False):
            save = _SAVE_FOLDER.fullmatch(_name(folder))
            if save is None or not fs.isdir(folder) or (older_than is not None and int(save.group(1)) >= older_than):
                continue
            for entry in fs.ls(folder, detail=False):
                if self.entry.fullmatch(_name(entry)):
                    fs.rm(entry, recursive=fs.isdir(entry))
            if not fs.ls(folder, detail=False):
                fs.rmdir(folder)
        if not fs.ls(root, detail=False):
            fs.rmdir(root)


def _name(entry: str) -> str:
    return entry.rstrip("/").rsplit("/", 1)[-1]


POWERSGD_ERRORS = SideFiles(".powersgd", re.compile(r"rank\d{5}\.pt(\.partial)?"))
OUTER_SYNC_NODES = SideFiles(".outer_sync", re.compile(r"node\d{5}(\.pt)?(\.partial)?"))
SIDE_FILES = (POWERSGD_ERRORS, OUTER_SYNC_NODES)


def retire_older_saves(checkpoint_path: object, step: int) -> None:
    """Once the checkpoint of step ``step`` is published at ``checkpoint_path``: remove the side files of its earlier
    saves (the checkpoint no longer names them)."""
    for kind in SIDE_FILES:
        kind.remove(checkpoint_path, older_than=step)


def remove_side_files(checkpoint_path: object) -> None:
    """Remove every side file of every save of ``checkpoint_path`` (the checkpoint is being removed)."""
    for kind in SIDE_FILES:
        kind.remove(checkpoint_path)
