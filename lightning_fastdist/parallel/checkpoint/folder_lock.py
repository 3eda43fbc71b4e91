"""One run writes a checkpoint folder at a time: two runs of one recipe in one working directory would share
``checkpoints/RECIPE/`` and its staging names, and one could publish the other's half-written file.

The process that writes a folder for its node holds a POSIX lock (``fcntl.lockf``) on
``<folder>/.lightning_fastdist-nodeNNNNN.lock`` until the fit ends (the file is then removed) or the process exits;
the kernel drops it when the process dies (SIGKILL included, which leaves the file, unlocked, for the next run to
take), it is not inherited by forked DataLoader workers, and NFS carries it (NLM/NFSv4). One file per node, so the
nodes of one job under ``outer_sync`` each hold theirs; a second job's node finds its lock taken.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from lightning_fastdist.parallel.checkpoint.save_failure import CheckpointSaveError

_held: dict[Path, int] = {}  # lock file -> its open descriptor, for every lock this process holds
_holder = os.getpid()  # whose locks _held lists: a forked child inherits the dict, not the locks


def lock_file(folder: Path, node: int) -> Path:
    """The lock file of node ``node`` in the checkpoint folder ``folder``."""
    return Path(folder) / f".lightning_fastdist-node{node:05d}.lock"


def hold_folder(folder: Path, node: int, keep: bool = True) -> bool:
    """Hold ``folder`` for this process's run as node ``node``'s writer (``keep=False``: only check that no other
    run holds it); return whether it was newly taken (not already held by this process).

    Raises:
        CheckpointSaveError: another live process holds it; one line naming it and the folder.
    """
    global _holder
    if _holder != os.getpid():
        _held.clear()
        _holder = os.getpid()
    path = lock_file(folder, node).resolve()
    if path in _held:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = _lock(path, folder)
    if not keep:
        _release(path, descriptor)
        return True
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
    _held[path] = descriptor
    return True


def _lock(path: Path, folder: Path) -> int:
    """An open descriptor of ``path`` holding its lock; retried where the run holding it released (and removed) it
    between the open and the lock, which would leave a lock on a file no longer there."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(descriptor)  # this process held no lock on it: closing drops nothing of ours
            raise CheckpointSaveError(
                f"checkpoint folder '{folder}' is being written by another run ({holder}): two runs saving there "
                "would replace each other's checkpoints. Give this run a folder of its own (ModelCheckpoint's "
                "dirpath), or stop the other run."
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                return descriptor
        except FileNotFoundError:
            pass
        os.close(descriptor)


def _release(path: Path, descriptor: int) -> None:
    """Remove the lock file while holding it (a run waiting on it then retries with a new one), then drop the lock."""
    path.unlink(missing_ok=True)
    os.close(descriptor)


def release_folders() -> None:
    """Let other runs write the folders this process holds (the fit that wrote them ended)."""
    if _holder != os.getpid():
        return
    while _held:
        _release(*_held.popitem())
