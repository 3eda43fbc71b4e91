"""Atomic checkpoint writes: a crash during a save never damages the checkpoint that was there before.

Every save is written under a staging name next to its target
(``<name>.partial``) and renamed onto the target only once complete. A
process killed mid-save leaves at most a ``.partial`` entry; every checkpoint
published earlier is intact. A file replaces an existing file in one atomic
rename, so a path such as ``last.ckpt`` always names a complete checkpoint. A
folder (or a change between file and folder) is swapped in atomically where the
OS can exchange two paths (Linux ``renameat2(RENAME_EXCHANGE)``) and the old one
deleted; elsewhere the old one is moved aside to ``<name>.replaced`` for the
instant between two renames.

:class:`ShardedCheckpointWriter` does this for distributed-checkpoint folders
(every rank writes its own shards), optionally in a background thread;
:func:`save_file_atomically` for a single file written by one rank.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
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


def staging_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is published."""
    return path.with_name(path.name + STAGING_SUFFIX)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def is_local_path(path: Any) -> bool:
    """Whether ``path`` is on the local file system (no ``s3://``-style protocol), where renames are atomic."""
    return fsspec.utils.get_protocol(str(path)) in ("file", "local")


def _is_file(path: Path) -> bool:
    return path.is_file() or path.is_symlink()


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


def publish(staged: Path, path: Path) -> None:
    """Rename the complete save ``staged`` onto ``path``, replacing whatever ``path`` held."""
    if not (path.exists() or path.is_symlink()) or (_is_file(staged) and _is_file(path)):
        os.replace(staged, path)  # atomic, also over an existing file
        return
    if _exchange(staged, path):
        _remove(staged)  # now the previous checkpoint
        return
    replaced = path.with_name(path.name + REPLACED_SUFFIX)
    _remove(replaced)
    os.replace(path, replaced)
    os.replace(staged, path)
    _remove(replaced)


def save_file_atomically(write: Callable[[Path], None], path: Path) -> None:
    """Call ``write(staging_file)`` and then publish the file at ``path`` (one process only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(path)
    _remove(staged)
    write(staged)
    with open(staged, "rb") as written:
        os.fsync(written.fileno())  # on disk before it is published: a power cut cannot publish a torn file
    publish(staged, path)


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
        asynchronous: return from :meth:`save` once the state is copied to host
            memory and write it in a background thread; the folder is published
            by rank 0 once every rank has finished. The next :meth:`save` (or
            :meth:`wait`) waits for the previous one.
        process_group: the group the background writes coordinate over. It must
            not be the group training communicates on (two threads would mix
            their collectives); create a dedicated gloo group for it. Ignored
            when ``asynchronous`` is ``False``.
    """

    def __init__(self, asynchronous: bool = False, process_group: dist.ProcessGroup | None = None) -> None:
        self.asynchronous = asynchronous
        self.process_group = process_group
        self._pending: Future | None = None

    def save(self, state: dict[str, Any], path: Path, write_extra: Callable[[Path], None] | None = None) -> None:
        """Save ``state`` (a distributed-checkpoint state dict) as the folder ``path``.

        Args:
            state: what :func:`torch.distributed.checkpoint.save` accepts.
            path: the folder to publish; the same on every rank.
            write_extra: called on rank 0 with the staging folder to add files
                of its own (for example non-tensor metadata) before publishing.
        """
        self.wait()
        path = Path(path)
        staged = staging_path(path)
        if _is_rank_zero():
            _remove(staged)
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

        On rank 0 that means the whole checkpoint is written and published;
        other ranks that need to see it published must also synchronise with rank 0.
        """
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
