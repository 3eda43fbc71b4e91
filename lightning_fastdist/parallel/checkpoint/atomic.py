"""Atomic checkpoint writes: a crash during a save never damages the checkpoint that was there before.

Every save is written under ``<name>.partial``, made durable (each of its files and folders ``fsync``ed) and only
then published: a file by one rename, a checkpoint folder by exchanging the two paths (Linux ``renameat2``), each
rename made durable by an ``fsync`` of the folder holding it. Where the file system cannot exchange (NFS and other
network file systems) the previous copy is first renamed aside to ``<stem>.replaced<suffix>``, a name
``ckpt_path="last"`` still finds, so a complete copy is findable at every instant. A link at the target (Lightning's
``save_last="link"``) is replaced, never written through. Any other folder is never replaced: a sharded save is merged
in, its index moved last so a crash leaves a folder that refuses to load. Only checkpoint files are ever deleted
(``docs/fault-tolerance.md``).

A save is published as one unit with the files it wrote beside its checkpoint (:mod:`.side_saves`): the checkpoint
names them, and :func:`publish` retires those of earlier saves once it is in place. Every rank of a multi-rank save
learns how the others' parts went (:mod:`.save_failure`): a failure on one rank ends the save on all of them, and a
full disk is one line naming the path and the bytes needed, the partial save removed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec.utils
import torch.distributed as dist

from lightning_fastdist.parallel.checkpoint.background_save import Publication, SavePart
from lightning_fastdist.parallel.checkpoint.checkpoint_files import (
    DEEPSPEED_INDEX,
    LIGHTNING_METADATA,
    SHARD_INDEX,
    delete_checkpoint,
    exists,
    is_checkpoint_folder,
    is_file_or_link,
    is_folder,
    is_states_folder,
    replaced_path,
    staging_path,
)
from lightning_fastdist.parallel.checkpoint.save_failure import (
    SAVE_ERRORS,
    agree_on_save,
    disk_full_error,
    failure_of,
    is_disk_full,
    state_bytes,
)
from lightning_fastdist.parallel.checkpoint.side_saves import retire_older_saves


def is_local_path(path: Any) -> bool:
    """Whether ``path`` is on the local file system (no ``s3://``-style protocol), where renames are atomic."""
    return fsspec.utils.get_protocol(str(path)) in ("file", "local")


def _describe_folder(path: Path) -> str:
    names = sorted(os.listdir(path))
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"a folder holding {shown}"


def check_save_target(path: Path, sharded: bool) -> None:
    """Raise :class:`IsADirectoryError` if a single-file checkpoint would replace a folder that is not a checkpoint.

    Call it on every rank before saving, so that all ranks stop alike (Lightning's contract). A sharded save onto
    any folder is accepted: it is written into the folder. A link is replaced whatever it points to.
    """
    path = Path(path)
    if not sharded and is_folder(path) and not is_checkpoint_folder(path):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path} is {_describe_folder(path)}, not a checkpoint, "
            f"and is never replaced. Save to a file inside it (e.g. {path / 'model.ckpt'}) or to another path."
        )


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2``); ``False`` where the OS or the file system cannot
    (:func:`publish` then renames twice)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # file system or kernel without the flag
        return False
    raise OSError(code, os.strerror(code), str(a))


def sync_folder(folder: Path) -> None:
    """Make the names in ``folder`` durable (a rename is on disk once its folder is synced); a file system that
    cannot sync a folder is left as it is."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)


def sync_tree(path: Path) -> None:
    """Make the file or folder ``path`` durable: every file's bytes, then every folder's names (a link is a name)."""
    if path.is_symlink():
        return
    if path.is_file():
        with open(path, "rb") as written:
            os.fsync(written.fileno())
        return
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(folder, name)):
                sync_tree(Path(folder, name))
        sync_folder(Path(folder))


def _merge_into(staged: Path, folder: Path) -> None:
    """Move the files of the sharded checkpoint ``staged`` into ``folder``, keeping what else is there.

    The indexes go first and come back last: in between the folder does not load as a checkpoint.
    """
    for name in os.listdir(staged):  # a states folder (DeepSpeed's) replaces only an earlier save's
        if is_folder(staged / name) and exists(folder / name) and not is_states_folder(folder / name):
            raise FileExistsError(f"{folder / name} is not part of a checkpoint and is never replaced; move it away.")
    indexes = (LIGHTNING_METADATA, DEEPSPEED_INDEX, SHARD_INDEX)  # SHARD_INDEX last: the folder loads once it is there
    for name in indexes:
        if is_file_or_link(folder / name):
            (folder / name).unlink()
    names = sorted(os.listdir(staged), key=lambda name: indexes.index(name) + 1 if name in indexes else 0)
    for name in names:
        if is_folder(staged / name) and exists(folder / name):
            delete_checkpoint(folder / name)
        os.replace(staged / name, folder / name)
    staged.rmdir()
    sync_folder(folder)


def publish(staged: Path, path: Path, step: int | None = None) -> None:
    """Publish the complete save ``staged`` at ``path``, durably; only a file, a link or a checkpoint folder there is
    replaced. With ``step`` (the global step the save holds), the files earlier saves wrote beside ``path`` go once it
    is in place (:func:`~.side_saves.retire_older_saves`).

    A single file onto any other folder raises :class:`IsADirectoryError`; a folder ``staged`` is merged into it.
    """
    sync_tree(staged)  # its bytes on disk before its name: a power cut never publishes a torn checkpoint
    if is_folder(path) and not is_checkpoint_folder(path):
        check_save_target(path, sharded=not is_file_or_link(staged))
        _merge_into(staged, path)
    else:
        _replace(staged, path)
    if step is not None:
        retire_older_saves(path, step)


def _replace(staged: Path, path: Path) -> None:
    """Put ``staged`` at ``path`` in place of the file, link or checkpoint folder there (if any), durably, with a
    complete copy at ``path`` or at its set-aside name at every instant."""
    aside = replaced_path(path)
    if not exists(path) or (is_file_or_link(staged) and is_file_or_link(path)):
        os.replace(staged, path)  # atomic, also over an existing file or link
    elif not exchange_paths(staged, path):  # `staged` is the previous checkpoint where the exchange was made
        delete_checkpoint(aside)  # a copy an earlier crash left aside: the checkpoint at `path` is complete
        os.replace(path, aside)  # from here until the next rename the complete copy is `aside`, a name resume finds
        sync_folder(path.parent)
        os.replace(staged, path)
    sync_folder(path.parent)  # the new name on disk before the previous copy goes
    delete_checkpoint(staged)
    delete_checkpoint(aside)  # the previous copy; or one a crash between the two renames left, now superseded


def write_staged(write: Callable[[Path], None], staged: Path, path: Path, expected_bytes: int | None) -> None:
    """``write(staged)``, where a full disk becomes one line naming ``path`` and the bytes needed."""
    try:
        write(staged)
    except SAVE_ERRORS as error:
        if is_disk_full(error, staged.parent):
            raise disk_full_error(path, staged, expected_bytes) from error
        raise


def save_file_atomically(
    write: Callable[[Path], None], path: Path, expected_bytes: int | None = None, step: int | None = None
) -> None:
    """Call ``write(staging_file)`` and then publish the file at ``path`` (one process only).

    Args:
        expected_bytes: about what the file takes (named in the line of a full disk).
        step: the global step of a checkpoint (not of a side file): its earlier saves' side files go once published.

    Raises:
        CheckpointSaveError: the disk is full (the partial file removed).
    """
    publish(write_staged_file(write, path, expected_bytes), Path(path), step)


def file_part(
    state: Any, path: Path, write: Callable[[Any, Path], None], step: int | None = None
) -> tuple[SavePart, Publication]:
    """A file written by one rank and published by it, as a :class:`~.background_save.BackgroundSave` part: its
    write ``write(state, staging_file)``, its publication at ``path`` (``step`` as for :func:`publish`)."""
    path = Path(path)

    def write_file(copy: Any) -> None:
        write_staged_file(lambda staged: write(copy, staged), path, state_bytes(copy))

    return SavePart(state, write_file), Publication(lambda: publish(staging_path(path), path, step), staging_path(path))


def write_staged_file(write: Callable[[Path], None], path: Path, expected_bytes: int | None = None) -> Path:
    """Call ``write(staging_file)`` for the file ``path`` and return the staging file, complete, for :func:`publish`
    (one process only); a failed write leaves no staging file.

    Raises:
        IsADirectoryError: ``path`` is a folder that is not a checkpoint (:func:`check_save_target`).
        CheckpointSaveError: the disk is full.
    """
    path = Path(path)
    check_save_target(path, sharded=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(path)
    delete_checkpoint(staged)
    try:
        write_staged(write, staged, path, expected_bytes)
    except SAVE_ERRORS:
        delete_checkpoint(staged)  # a partial save of ours: never left to fill the disk
        raise
    return staged


def _agree_or_remove(failure: BaseException | None, staged: Path, path: Path) -> None:
    """:func:`~.save_failure.agree_on_save`; where a rank failed, rank 0 removes the partial save (every rank has
    finished its part: the agreement is a barrier) before raising."""
    try:
        agree_on_save(failure, path)
    except SAVE_ERRORS:
        if _is_rank_zero():
            delete_checkpoint(staged)
        raise


def save_folder_atomically(write: Callable[[Path], None], path: Path, step: int | None = None) -> None:
    """Every rank calls this, and ``write(staging_folder)``, a collective that writes a checkpoint folder
    (DeepSpeed's ``save_checkpoint``); rank 0 then publishes the complete folder at ``path``. A failure on any rank
    raises on every rank (:class:`~.save_failure.CheckpointSaveError` where it was another's)."""
    staged = stage_folder(write, path)
    agree_on_save(failure_of(lambda: publish(staged, Path(path), step)) if _is_rank_zero() else None, Path(path))


def stage_folder(write: Callable[[Path], None], path: Path) -> Path:
    """The first steps of :func:`save_folder_atomically`: every rank calls ``write(staging_folder)`` into a fresh
    ``<name>.partial``; return it once every rank's call returned (a failure raises on every rank, the folder
    removed). A background save writes the rest of it before rank 0 publishes it."""
    path = Path(path)
    staged = staging_path(path)
    agree_on_save(failure_of(lambda: delete_checkpoint(staged)) if _is_rank_zero() else None, path)
    _agree_or_remove(failure_of(lambda: write_staged(write, staged, path, None)), staged, path)
    return staged


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
