"""What a strategy asks about nodes, as one interface (:class:`AcrossNodes`) whose every default is Lightning's own
behaviour, and its null case, :class:`OneWorld`: one torch.distributed world holds every rank of the job. The two forms
across nodes fill it in (``torchft_form.py``), so that each strategy calls the same methods from its own hooks whichever
form, if any, is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn

from lightning_fastdist.parallel.comm.accounting import CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock


@dataclass(frozen=True)
class TrainingStart:
    """What a strategy hands its across-nodes object when training starts.

    Attributes:
        model: the model as trained (wrapped or sharded); ``module``: the LightningModule in it.
        stats: with ``clock``, where the bytes sent across nodes and the waits for them count.
    """

    model: nn.Module
    module: pl.LightningModule
    optimizers: Sequence[torch.optim.Optimizer]
    timeout: timedelta
    stats: CommStats | None = None
    clock: ExposedCommClock | None = None


class AcrossNodes:
    """What a strategy does about nodes on its hooks; each default is what Lightning's strategy does in one world.

    Attributes:
        option: the strategy option of the form across nodes (``"outer_sync"``, ``"replica_groups"``); ``None``: none.
        collectives: the collectives across nodes a strategy logs beside its own, as ``comm/<name>_bytes_per_step``.
        stop_save_resumes: whether the checkpoint a stop signal saves can resume the job; where it cannot
            (``outer_sync``), it is saved under a name of its own, never in place of the ``last`` checkpoint.
    """

    option: str | None = None
    collectives: tuple[str, ...] = ()
    stop_save_resumes = True

    def comm_hook_inside_node(self, comm_hook: str) -> str:
        """The DDP comm hook this form runs inside a node for the ``comm_hook`` option a user gave."""
        return comm_hook

    def check_sharding(self, sharding: str) -> None:
        """Refuse, at construction, an FSDP ``sharding`` this form cannot train."""

    def check_launch(self, num_nodes: int) -> None:
        """Refuse, before any process starts, what cannot run on ``num_nodes`` nodes."""

    def check_blocks(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """Refuse, before any process starts, options that do not fit ``model``'s outermost ``blocks``."""

    def join(self, strategy: ParallelStrategy, backend: str, timeout: timedelta) -> None:
        """Join the process group this form trains in, after the strategy set its ranks (the job's: Lightning's)."""

    def resume_ranks(self, strategy: ParallelStrategy) -> tuple[int, int]:
        """This rank and the ranks whose random states a checkpoint keeps."""
        return strategy.global_rank, strategy.world_size

    def training_ranks(self, world_size: int) -> int:
        """The ranks training now (what SpeedMonitor counts)."""
        return world_size

    def start(self, training: TrainingStart) -> None:
        """Start training across nodes, after Lightning restored a checkpoint's state."""

    def before_batch(self) -> None:
        """At each training batch's start."""

    def averaging_after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's optimizer ``closure`` (forward and backward), and what this form does to the gradients after."""
        return closure

    def after_step(self, trainer: pl.Trainer) -> None:
        """After each optimizer step."""

    def evaluation_sampler(self, strategy: ParallelStrategy) -> dict[str, int] | None:
        """The distributed sampler's arguments while not training, where this form shares data otherwise."""
        return None

    def reduce(self, module: pl.LightningModule | None, reduced: Any, reduce_op: Any) -> Any:
        """``reduced``, which Lightning reduced over the world with ``reduce_op``, as the job reduces it."""
        return reduced

    def reduce_boolean_decision(
        self,
        module: pl.LightningModule | None,
        decision: bool,
        all: bool,  # noqa: A002 - Lightning's name
        device: torch.device,
        in_world: Callable[[bool, bool], bool],
    ) -> bool:
        """Lightning's ``reduce_boolean_decision`` over the job's ranks; ``in_world``: Lightning's own."""
        return in_world(decision, all)

    def evaluate_on_global_weights(self, model: nn.Module) -> None:
        """At evaluation's start: give ``model`` the weights every node agrees on."""

    def back_to_own_weights(self, model: nn.Module) -> None:
        """At evaluation's end: put back what :meth:`evaluate_on_global_weights` replaced."""

    def finish(self, model: nn.Module) -> None:
        """After fit: the weights the model keeps."""

    def weights_to_save(self, model: nn.Module, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The weights a checkpoint keeps: what ``read`` (Lightning's state dict of ``model``) returns."""
        return read()

    def save(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        checkpoint: dict[str, Any],
        filepath: Any,
        trainer: pl.Trainer,
    ) -> None:
        """While fitting, write what this form keeps beside ``filepath`` and put its shared part into ``checkpoint``;
        call on every rank before the checkpoint is written."""

    def writes_checkpoint(self, node_rank: int) -> bool:
        """Whether this process's world writes the checkpoint being saved (call on every rank): the job's world."""
        return True

    def writes_files(self, strategy: ParallelStrategy) -> bool:
        """Whether this rank writes a checkpoint's one file, and removes it when ModelCheckpoint prunes it."""
        return strategy.is_global_zero

    def resume_refusal(
        self, checkpoint: dict[str, Any], checkpoint_path: Any, trainer: pl.Trainer | None
    ) -> str | None:
        """Why a fit of ``trainer`` cannot resume from ``checkpoint`` (read from ``checkpoint_path``) under this form:
        one line naming it, or ``None``. A ``last`` checkpoint refused falls back to the newest that resumes."""
        return None

    def load(self, checkpoint: dict[str, Any], checkpoint_path: Any, trainer: pl.Trainer) -> None:
        """Read what this form keeps of a checkpoint a fit resumes from (applied by :meth:`start`)."""

    def teardown(self) -> None:
        """Stop what this form started in this process."""


class OneWorld(AcrossNodes):
    """No form across nodes: the job is one torch.distributed world, and every hook does what Lightning's does."""
