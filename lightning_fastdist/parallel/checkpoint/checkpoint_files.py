"""What on disk is a checkpoint of ours, and the only way anything is deleted: a save, a publish and a cleanup may
remove a checkpoint file, a folder of checkpoint files, or a link (never what it points to), and nothing else.

Names a save uses besides the checkpoint's own: ``<name>.partial`` while it is written, ``<stem>.replaced<suffix>`` for
the previous copy while a publish without ``RENAME_EXCHANGE`` swaps the two (a name ``ckpt_path="last"`` still finds).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

STAGING_SUFFIX = ".partial"
REPLACED_MARK = ".replaced"
# The distributed checkpoint's index of the shards (torch.distributed.checkpoint): without it a folder does not load.
SHARD_INDEX = ".metadata"
# What Lightning's strategies write next to the shards (the non-tensor state); its index too.
LIGHTNING_METADATA = "meta.pt"
# DeepSpeed's index: names the folder inside the checkpoint (the tag) that holds the per-rank states.
DEEPSPEED_INDEX = "latest"
# Every file a sharded checkpoint consists of: the indexes, the shards, per-rank metadata, and their temporary
# names; for DeepSpeed also its conversion scripts and per-rank model and optimizer states.
_CHECKPOINT_FILE = re.compile(
    r"(\.metadata|meta\.pt|__\d+\.metadata|.+\.distcp"
    r"|latest|zero_to_(fp32|torch)\.py|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(model|optim)_states\.pt"
    r"|mp_rank_\d+_model_states\.pt)(\.tmp)?"
)
# How a file torch.save wrote starts: a zip archive (torch >= 1.6) or a raw pickle (protocol 2+).
TORCH_FILE_MAGIC = (b"PK\x03\x04", b"\x80")


def staging_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is published."""
    return path.with_name(path.name + STAGING_SUFFIX)


def replaced_path(path: Path) -> Path:
    """Where the previous copy of ``path`` waits while a publish without ``RENAME_EXCHANGE`` moves the new one in:
    ``last.ckpt`` -> ``last.replaced.ckpt``, still a ``last*.ckpt`` that ``ckpt_path="last"`` finds."""
    return path.with_name(f"{path.stem}{REPLACED_MARK}{path.suffix}")


def replaced_original(path: Path) -> Path | None:
    """The checkpoint whose previous copy ``path`` holds (the inverse of :func:`replaced_path`), or ``None``."""
    stem, mark, suffix = path.name.rpartition(REPLACED_MARK)
    if not mark or not stem or (suffix and (not suffix.startswith(".") or "." in suffix[1:])):
        return None
    return path.with_name(stem + suffix)


def exists(path: Path) -> bool:
    """Whether anything is at ``path``, a dangling link included."""
    return path.exists() or path.is_symlink()


def is_file_or_link(path: Path) -> bool:
    """Whether ``path`` is replaced or removed as one directory entry: a file, or a link (whatever it points to: a
    save never writes through a link, Lightning's ``save_last="link"`` included)."""
    return path.is_symlink() or path.is_file()


def is_folder(path: Path) -> bool:
    """Whether ``path`` is a folder itself, not a link to one."""
    return path.is_dir() and not path.is_symlink()


def is_states_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of checkpoint files only (DeepSpeed's tag folder inside its checkpoint)."""
    return is_folder(path) and all(_CHECKPOINT_FILE.fullmatch(name) for name in os.listdir(path))


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a sharded checkpoint and nothing else, so a save may replace it."""
    if not is_folder(path):
        return False
    names = os.listdir(path)
    has_index = SHARD_INDEX in names or LIGHTNING_METADATA in names or DEEPSPEED_INDEX in names
    return has_index and all(_CHECKPOINT_FILE.fullmatch(name) or is_states_folder(path / name) for name in names)


def looks_like_our_save(path: Path) -> bool:
    """Whether ``path`` holds nothing but what a checkpoint save of ours writes: a torch file (or an empty one, as a
    save cut short leaves it), a link, or a folder of checkpoint files only (an empty one too)."""
    if path.is_symlink():
        return True
    if path.is_file():
        with open(path, "rb") as file:
            head = file.read(4)
        return not head or head.startswith(TORCH_FILE_MAGIC)
    names = os.listdir(path) if is_folder(path) else []
    return is_folder(path) and all(_CHECKPOINT_FILE.fullmatch(name) or is_states_folder(path / name) for name in names)


def delete_checkpoint(path: Path) -> None:
    """Delete the file, link or checkpoint folder at ``path``; a folder keeps anything that is not a checkpoint file.

    Raises :class:`FileExistsError` if such files keep the folder from being removed.
    """
    if not exists(path):
        return
    if is_file_or_link(path):
        path.unlink()
        return
    for name in os.listdir(path):
        if _CHECKPOINT_FILE.fullmatch(name) and is_file_or_link(path / name):
            (path / name).unlink()
        elif is_states_folder(path / name):
            delete_checkpoint(path / name)
    try:
        path.rmdir()
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise FileExistsError(
            f"{path} holds files that are not part of a checkpoint ({', '.join(sorted(os.listdir(path)))}); "
            "they were left in place. Move them away and save again."
        ) from None


def size_on_disk(path: Path) -> int:
    """The bytes of the file or folder at ``path`` (0 if there is none); a link counts as nothing."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file() and not entry.is_symlink())
