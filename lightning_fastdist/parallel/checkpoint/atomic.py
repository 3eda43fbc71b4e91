"""Atomic checkpoint writes: a crash during a save never damages the checkpoint that was there before.

Every save is written under ``<name>.partial`` and published once complete: a file by one rename, a checkpoint
folder by exchanging the two paths. Any other folder is never replaced: a sharded save is merged in, its index moved
last so a crash leaves a folder that refuses to load. Only checkpoint files are ever deleted
(``docs/fault-tolerance.md``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fsspec.utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

STAGING_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
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


def staging_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is published."""
    return path.with_name(path.name + STAGING_SUFFIX)


def is_local_path(path: Any) -> bool:
    """Whether ``path`` is on the local file system (no ``s3://``-style protocol), where renames are atomic."""
    return fsspec.utils.get_protocol(str(path)) in ("file", "local")


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _is_file(path: Path) -> bool:
    return path.is_file() or (path.is_symlink() and not path.is_dir())


def _is_states_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of checkpoint files only (DeepSpeed's tag folder inside its checkpoint)."""
    return (
        not path.is_symlink() and path.is_dir() and all(_CHECKPOINT_FILE.fullmatch(name) for name in os.listdir(path))
    )


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a sharded checkpoint and nothing else, so a save may replace it."""
    if path.is_symlink() or not path.is_dir():
        return False
    names = os.listdir(path)
    has_index = SHARD_INDEX in names or LIGHTNING_METADATA in names or DEEPSPEED_INDEX in names
    return has_index and all(_CHECKPOINT_FILE.fullmatch(name) or _is_states_folder(path / name) for name in names)


def _describe_folder(path: Path) -> str:
    names = sorted(os.listdir(path))
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"a folder holding {shown}"


def check_save_target(path: Path, sharded: bool) -> None:
    """Raise :class:`IsADirectoryError` if a single-file checkpoint would replace a folder that is not a checkpoint.

    Call it on every rank before saving, so that all ranks stop alike (Lightning's contract). A sharded save onto
    any folder is accepted: it is written into the folder.
    """
    path = Path(path)
    if not sharded and path.is_dir() and not is_checkpoint_folder(path):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path} is {_describe_folder(path)}, not a checkpoint, "
            f"and is never replaced. Save to a file inside it (e.g. {path / 'model.ckpt'}) or to another path."
        )


def _delete_checkpoint(path: Path) -> None:
    """Delete the file or checkpoint folder at ``path``; a folder keeps anything that is not a checkpoint file.

    Raises :class:`FileExistsError` if such files keep the folder from being removed.
    """
    if not _exists(path):
        return
    if _is_file(path):
        path.unlink()
        return
    for name in os.listdir(path):
        if _CHECKPOINT_FILE.fullmatch(name) and _is_file(path / name):
            (path / name).unlink()
        elif _is_states_folder(path / name):
            _delete_checkpoint(path / name)
    try:
        path.rmdir()
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise FileExistsError(
            f"{path} holds files that are not part of a checkpoint ({', '.join(sorted(os.listdir(path)))}); "
            "they were left in place. Move them away and save again."
        ) from None


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2``); ``False`` where the OS cannot."""
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


def _merge_into(staged: Path, folder: Path) -> None:
    """Move the files of the sharded checkpoint ``staged`` into ``folder``, keeping what else is there.

    The indexes go first and come back last: in between the folder does not load as a checkpoint.
    """
    for name in os.listdir(staged):  # a states folder (DeepSpeed's) replaces only an earlier save's
        if (staged / name).is_dir() and _exists(folder / name) and not _is_states_folder(folder / name):
            raise FileExistsError(f"{folder / name} is not part of a checkpoint and is never replaced; move it away.")
    indexes = (LIGHTNING_METADATA, DEEPSPEED_INDEX, SHARD_INDEX)  # SHARD_INDEX last: the folder loads once it is there
    for name in indexes:
        if _is_file(folder / name):
            (folder / name).unlink()
    names = sorted(os.listdir(staged), key=lambda name: indexes.index(name) + 1 if name in indexes else 0)
    for name in names:
        if (staged / name).is_dir() and _exists(folder / name):
            _delete_checkpoint(folder / name)
        os.replace(staged / name, folder / name)
    staged.rmdir()


def publish(staged: Path, path: Path) -> None:
    """Publish the complete save ``staged`` at ``path``; only a file or a checkpoint folder there is replaced.

    A single file onto any other folder raises :class:`IsADirectoryError`; a folder ``staged`` is merged into it.
    """
    if not _exists(path) or (_is_file(staged) and _is_file(path)):
        os.replace(staged, path)  # atomic, also over an existing file
        return
    if path.is_dir() and not is_checkpoint_folder(path):
        check_save_target(path, sharded=not _is_file(staged))
        _merge_into(staged, path)
        return
    if _exchange(staged, path):
        _delete_checkpoint(staged)  # now the previous checkpoint
        return
    replaced = path.with_name(path.name + REPLACED_SUFFIX)
    _delete_checkpoint(replaced)
    os.replace(path, replaced)
    os.replace(staged, path)
    _delete_checkpoint(replaced)


def save_file_atomically(write: Callable[[Path], None], path: Path) -> None:
    """Call ``write(staging_file)`` and then publish the file at ``path`` (one process only)."""
    path = Path(path)
    check_save_target(path, sharded=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(path)
    _delete_checkpoint(staged)
    write(staged)
    with open(staged, "rb") as written:
        os.fsync(written.fileno())  # on disk before it is published: a power cut cannot publish a torn file
    publish(staged, path)


def save_folder_atomically(write: Callable[[Path], None], path: Path) -> None:
    """Every rank calls this, and ``write(staging_folder)``, a collective that writes a checkpoint folder
    (DeepSpeed's ``save_checkpoint``); rank 0 then publishes the complete folder at ``path``."""
    path = Path(path)
    staged = staging_path(path)
    if _is_rank_zero():
        _delete_checkpoint(staged)
    _barrier()
    write(staged)
    _barrier()
    if _is_rank_zero():
        publish(staged, path)
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _then_publish(written: Future, staged: Path, path: Path) -> Future:
    """A future that completes once ``written`` has and ``staged`` is published at ``path`` (from the writer thread)."""
    published: Future = Future()

    def on_written(done: Future) -> None:
        try:
            done.result()
            publish(staged, path)
            published.set_result(None)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            published.set_exception(error)

    written.add_done_callback(on_written)
    return published


class ShardedCheckpointWriter:
    """Saves a distributed checkpoint folder atomically; every rank calls :meth:`save` and :meth:`wait`.

    Args:
        asynchronous: return from :meth:`save` once the state is in host memory and write it in a background
            thread; rank 0 publishes the folder once every rank has finished. The next save waits for the previous.
        process_group: the group the background writes coordinate over: a dedicated gloo group, never the one
            training communicates on (two threads would mix their collectives).
    """

    def __init__(self, asynchronous: bool = False, process_group: dist.ProcessGroup | None = None) -> None:
        self.asynchronous = asynchronous
        self.process_group = process_group
        self._pending: Future | None = None

    def save(self, state: dict[str, Any], path: Path, write_extra: Callable[[Path], None] | None = None) -> None:
        """Save ``state`` (a distributed-checkpoint state dict) as the folder ``path``.

        Args:
            path: the folder to publish; the same on every rank.
            write_extra: called on rank 0 with the staging folder to add files of its own (non-tensor metadata).
        """
        self.wait()
        path = Path(path)
        staged = staging_path(path)
        if _is_rank_zero():
            _delete_checkpoint(staged)
            staged.mkdir(parents=True)
            if write_extra is not None:
                write_extra(staged)
        _barrier()
        if not self.asynchronous:
            dcp.save(state, checkpoint_id=staged)
            _barrier()
            if _is_rank_zero():
                publish(staged, path)
            _barrier()
            return
        written = dcp.async_save(state, checkpoint_id=staged, process_group=self.process_group)
        # Rank 0 coordinates: its save completes only after every rank has written its shards.
        self._pending = _then_publish(written, staged, path) if _is_rank_zero() else written

    def wait(self) -> None:
        """Block until this rank's part of the pending background save (if any) is done.

        Only on rank 0 is the checkpoint then published; other ranks that need it must synchronise with rank 0.
        """
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
