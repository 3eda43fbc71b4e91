"""A strategy's checkpoint writes, where every engine's save ends: in place, or with ``async_checkpointing`` in the
background while the fit trains on (:class:`~lightning_fastdist.parallel.checkpoint.background_save.BackgroundSave`).

A save goes to the background only during a running fit and before a stop was requested: a stop's save is complete
before the process exits, and a save outside a fit (``trainer.save_checkpoint`` after it) before it returns, since
the caller reads it next. A background save is waited for by the next save, a load, the end of the fit (its failure
raised there, on every rank), and an exception (its failure logged: the exception is what ends the fit); removing the
checkpoint a save replaces waits for it to be published. ``docs/checkpoints.md`` has when to turn it on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_fastdist.parallel.checkpoint.atomic import check_save_target, file_part, is_local_path
from lightning_fastdist.parallel.checkpoint.background_save import BackgroundSave, SavePart
from lightning_fastdist.parallel.checkpoint.sharded_folder import CheckpointShardsPlanner, sharded_part


class CheckpointSaves:
    """One strategy's checkpoint writes; its :class:`~..common.shared_hooks.SharedHooks` owns it.

    Args:
        strategy: the strategy saving (its ``checkpoint_io``, ``timeout`` and LightningModule are read when it saves).
        asynchronous: ``async_checkpointing``: write during a fit in the background.
    """

    def __init__(self, strategy: ParallelStrategy, asynchronous: bool) -> None:
        self.strategy = strategy
        self.asynchronous = asynchronous
        self.background = BackgroundSave()

    def setup(self) -> None:
        """In a strategy's ``setup`` (collective): with ``async_checkpointing``, the first makes the gloo group the
        background saves agree over (a group of their own: their collectives run beside training's)."""
        if self.asynchronous and not self.background.asynchronous:
            timeout = self.strategy.timeout
            self.background.go_background(dist.new_group(backend="gloo", timeout=timeout) if _distributed() else None)

    def in_background(self) -> bool:
        """Whether a save now returns before it is written: ``async_checkpointing``, a fit running, no stop."""
        module = self.strategy.lightning_module
        trainer = module._trainer if module is not None else None
        return (
            self.background.asynchronous
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
            and not trainer.received_sigterm
        )

    def one_file(
        self, checkpoint: dict[str, Any], filepath: Any, writer: bool, side_files: list[SavePart], options: Any = None
    ) -> None:
        """Save ``checkpoint`` as one file written by the ``writer`` rank, with this rank's ``side_files`` (each
        published on its own, into the save's folder, before the checkpoint naming them). Call on every rank.

        A remote path or a ``checkpoint_io`` of another kind (``AsyncCheckpointIO``): the checkpoint is written now
        by ``checkpoint_io`` itself, once the side files are; ``options``: its ``storage_options``.

        Raises:
            IsADirectoryError: on every rank, ``filepath`` is a folder that is not a checkpoint.
            CheckpointSaveError: on every rank, a part of this save (or of the save in flight) failed.
        """
        path = Path(filepath)
        checkpoint_io = self.strategy.checkpoint_io
        if not (isinstance(checkpoint_io, TorchCheckpointIO) and is_local_path(filepath)):
            self.background.save(path, side_files, None, in_background=False)
            if writer:  # e.g. a remote or asynchronous writer, as Lightning's save_checkpoint calls it
                checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=options)
            return
        check_save_target(path, sharded=False)  # on every rank first, so that all stop alike
        parts, publication = list(side_files), None
        if writer:
            write = _file_writer(checkpoint_io, options)
            part, publication = file_part(checkpoint, path, write, checkpoint.get("global_step"))
            parts.append(part)
        self.background.save(path, parts, publication, self.in_background())

    def sharded(self, tensors: dict[str, Any], small_files: dict[str, Any], path: Path, step: int | None) -> None:
        """Save ``tensors`` (a distributed-checkpoint state dict) as the folder ``path``, rank 0 adding
        ``small_files`` (name: object ``torch.save``d there). Call on every rank."""
        in_background = self.in_background()
        group = self.background.group if in_background else None
        part, publication = sharded_part(tensors, small_files, path, group, step, CheckpointShardsPlanner)
        self.background.save(path, [part], publication, in_background)

    def remove(self, filepath: Any, writer: bool, *beside: Callable[[Any], None]) -> None:
        """The ``writer`` rank removes the checkpoint ``filepath`` and what ``beside`` removes of its side files, once
        the saves in flight are published (never the one being replaced before its replacement is complete)."""
        if writer:
            self.background.after_published(lambda: self._remove(filepath, beside))

    def _remove(self, filepath: Any, beside: tuple[Callable[[Any], None], ...]) -> None:
        self.strategy.checkpoint_io.remove_checkpoint(filepath)
        for remove in beside:
            remove(filepath)

    def wait(self) -> None:
        """Block until the save in flight is published (before a load, which may read it); raise its failure."""
        self.background.wait()

    def on_exception(self) -> None:
        """An exception ends the fit: the save in flight is finished (or, failing, left unpublished), quietly."""
        self.background.finish_quietly()

    def teardown(self) -> None:
        """The end of a fit: the last save published (its failure raised here) and the host copies freed."""
        self.background.release_memory()


def _file_writer(checkpoint_io: TorchCheckpointIO, options: Any) -> Callable[[Any, Path], None]:
    """How the one file is written: Lightning's ``TorchCheckpointIO`` writes ``torch.save`` into a buffer first (the
    file's bytes held twice in memory, twice more in the copy it writes); the same bytes go straight to the staging
    file. A subclass, or ``storage_options`` (which Lightning's refuses), go through ``save_checkpoint``."""
    if type(checkpoint_io) is TorchCheckpointIO and options is None:
        return lambda state, staged: torch.save(state, staged)
    return lambda state, staged: checkpoint_io.save_checkpoint(state, staged, storage_options=options)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
