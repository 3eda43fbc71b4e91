"""``outer_sync``: one torch.distributed world per node, DiLoCo across them.

torchft's ``DiLoCo`` hooks the optimizer's ``step`` on each process that talks across nodes. Under DDP that is each
node's local rank 0, so the slow link carries each pseudo-gradient once per node, and it broadcasts each fragment
after its outer step to the node's other ranks on fast links. Under FSDP every rank talks to the ranks holding the
same shard on the other nodes, and nothing is broadcast. Evaluation and the weights after fit are the global ones,
the same on every node; a node restarted while the others train (``min_nodes``) takes a live node's state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_fastdist.parallel.across_nodes.group import ReplicaGroup
from lightning_fastdist.parallel.across_nodes.outer_sync.fragments import split_into_fragments
from lightning_fastdist.parallel.across_nodes.outer_sync.run import OUTER_ALL_REDUCE, OuterSyncRun
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync
from lightning_fastdist.parallel.across_nodes.rejoin import Rejoined
from lightning_fastdist.parallel.fsdp.sharding import reshard_everywhere
from lightning_fastdist.parallel.plan.blocks import outermost_block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.parallel_plan import BlocksOption
from lightning_fastdist.strategies.across_nodes.interface import TrainingStart
from lightning_fastdist.strategies.across_nodes.node_process_groups import broadcast_in_node
from lightning_fastdist.strategies.across_nodes.outer_sync_checkpoint import (
    CHECKPOINT_KEY,
    read_node_state,
    restore_node_state,
    resume_refusal,
    save_node_state,
)
from lightning_fastdist.strategies.across_nodes.torchft_form import TorchftForm
from lightning_fastdist.strategies.checkpoint.exact_resume import RNG_KEY
from lightning_fastdist.trainer.loop_state import training_position


class OuterSyncJob(TorchftForm):
    """The outer synchronisation of one strategy (``owner`` names it in errors; ``blocks``: the strategy's option, the
    blocks the fragments are made of; ``sharded``: each rank of a node holds a shard of the weights, as under FSDP,
    whose units are resharded before the weights are swapped)."""

    powersgd_refusal = "outer_sync crosses the slow link only every `every` steps, and inside a node"
    hsdp_refusal = "outer_sync synchronises across nodes every `every` steps and sharding='hsdp' every step"
    collectives = (OUTER_ALL_REDUCE,)
    stop_save_resumes = False  # each node stops on its own: its stop save holds the global weights only (save)
    settings: OuterSync

    def __init__(self, settings: OuterSync, owner: str, blocks: BlocksOption, sharded: bool = False) -> None:
        super().__init__(settings, owner, sharded)
        self.blocks = blocks
        self._fragments: list[nn.Module] = []
        self._steps = 0  # optimizer steps of this fit (the schedule's clock on every rank)
        self._hook: Any = None
        self._own_weights: list[torch.Tensor] | None = None
        self.fragment_numels: list[int] = []  # elements of each fragment, once fitting started
        self._pending_resume: tuple[dict, dict] | None = None

    def check_blocks(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """Raise the one-line ``ValueError`` of ``fragments`` that do not divide ``model``'s blocks."""
        split_into_fragments(model, blocks, self.settings.fragments)

    def _check_optimizers(self, training: TrainingStart) -> None:
        if len(training.optimizers) != 1:
            raise ValueError(
                f"{self.owner}: outer_sync steps one optimizer and configure_optimizers returned "
                f"{len(training.optimizers)}: return one optimizer, or remove outer_sync."
            )

    def _prepare(self, training: TrainingStart) -> None:
        block_modules = outermost_block_modules(training.module, resolve_blocks(training.module, self.blocks))
        self._fragments = split_into_fragments(training.model, block_modules, self.settings.fragments)
        self.fragment_numels = [sum(p.numel() for p in fragment.parameters()) for fragment in self._fragments]

    def _new_run(
        self, training: TrainingStart, group: ReplicaGroup, report: Callable[[str], None] | None
    ) -> OuterSyncRun:
        position = functools.partial(training_position, training.module.trainer)
        return OuterSyncRun(
            self.settings,
            training.model,
            self._fragments,
            training.optimizers[0],
            group,
            training.timeout,
            training.stats,
            training.clock,
            report,
            position,
        )

    def _started(self, model: nn.Module, optimizer: torch.optim.Optimizer, rejoined: Rejoined | None) -> None:
        """Under DDP, hook the optimizer to share each outer step in the node; put back what :meth:`load` read, unless
        a live node's state replaced it."""
        if not self.sharded:
            self._hook = optimizer.register_step_post_hook(self._after_step)  # runs after DiLoCo's own
        self._steps = rejoined.step if rejoined is not None else 0
        if rejoined is not None:
            self._pending_resume = None
            return
        self._resume(model, optimizer)

    def _after_step(self, *_: Any) -> None:
        """After each optimizer step that applied a fragment's outer step, local rank 0 tells the node's other ranks
        which fragment (DiLoCo retries one whose all-reduce failed) through the node's store (host only: no device
        sync), then sends them its weights."""
        self._steps += 1
        if self._steps % self.settings.steps_between_fragments or dist.get_world_size() == 1:
            return
        store = self.process_groups.store
        assert store is not None
        key = f"applied/{self._steps}"
        if self.run is not None:
            store.set(key, str(self.run.fragment_due))
        fragment = int(store.get(key))
        broadcast_in_node(self._fragments[fragment].parameters())
        if self.run is not None:  # every other rank read it before joining the broadcast
            store.delete_key(key)

    def evaluate_on_global_weights(self, model: nn.Module) -> None:
        """Give ``model`` the global weights (under DDP local rank 0 holds them and sends them to the node's other
        ranks), keeping a copy of this rank's own for :meth:`back_to_own_weights`. Call on every rank of the node."""
        self._reshard(model)
        if not self._fragments:
            return
        with torch.no_grad():
            self._own_weights = [p.detach().clone() for p in model.parameters()]
        self._load_global_weights(model)

    def _load_global_weights(self, model: nn.Module) -> None:
        if self.run is not None:
            self.run.load_global_weights()
        if not self.sharded:
            broadcast_in_node(model.parameters())

    def back_to_own_weights(self, model: nn.Module) -> None:
        """Put back the weights :meth:`evaluate_on_global_weights` kept."""
        self._reshard(model)
        if self._own_weights is None:
            return
        with torch.no_grad():
            for parameter, own in zip(model.parameters(), self._own_weights):
                parameter.copy_(own)
        self._own_weights = None

    def finish(self, model: nn.Module) -> None:
        """After fit: the model keeps the global weights (what every node agrees on)."""
        self._reshard(model)
        if self._fragments:
            self._load_global_weights(model)

    def weights_to_save(self, model: nn.Module, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The global weights (the same on every node), so that a checkpoint loads into a plain model as what the
        nodes agreed on; this node's own are put back after (unless it held the global ones already: a checkpoint
        written during validation)."""
        self._reshard(model)
        swapping = self._own_weights is None
        if swapping:
            self.evaluate_on_global_weights(model)
        try:
            return {name: value.clone() for name, value in read().items()}
        finally:
            if swapping:
                self.back_to_own_weights(model)

    def _reshard(self, model: nn.Module) -> None:
        """Under FSDP, the sharded parameters in place of gathered ones: they are what the weights swap."""
        if self.sharded:
            reshard_everywhere(model)

    def save(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        checkpoint: dict[str, Any],
        filepath: Any,
        trainer: pl.Trainer,
    ) -> None:
        """While fitting, write this node's own state beside ``filepath`` and the shared part into ``checkpoint``.

        A checkpoint written on a stop signal (our preemption handler sets ``received_sigterm`` before it saves) holds
        the global weights only, marked as such: each node stops on its own (the nodes do not agree on a step yet), so
        a wait for the others could wait forever."""
        self._reshard(model)
        if trainer.received_sigterm and "loops" in checkpoint:
            checkpoint[CHECKPOINT_KEY] = {"written_on_stop": True}
        elif self._fragments and "loops" in checkpoint:
            assert self.process_groups.group is not None
            save_node_state(
                self.process_groups.group,
                self.run,
                model,
                optimizers[0],
                checkpoint,
                filepath,
                checkpoint.get(RNG_KEY),
                trainer.global_step,
            )

    def writes_checkpoint(self, node_rank: int) -> bool:
        """Node 0 writes the checkpoint the nodes share (each node wrote its own state beside it)."""
        self.wrote_last_checkpoint = node_rank == 0
        return self.wrote_last_checkpoint

    def resume_refusal(
        self, checkpoint: dict[str, Any], checkpoint_path: Any, trainer: pl.Trainer | None
    ) -> str | None:
        """A checkpoint a fit cannot resume from exactly: one written on a stop signal, while an all-reduce was in
        flight, or by another number of nodes or ranks (checked on what the checkpoint itself holds)."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        group = self.process_groups.group
        if saved is None or trainer is None or not trainer.training or group is None:
            return None
        refusal = resume_refusal(saved, group.num_nodes, group.ranks_per_node)
        return None if refusal is None else f"checkpoint '{checkpoint_path}' cannot resume this run: {refusal}"

    def load(self, checkpoint: dict[str, Any], checkpoint_path: Any, trainer: pl.Trainer) -> None:
        """Read this node's own state of a checkpoint a fit resumes from (refusing one that cannot resume exactly):
        its ranks' random states replace node 0's in ``checkpoint`` at once, the rest is applied by :meth:`start`. A
        checkpoint of a run without outer_sync starts it afresh from its weights."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None or not trainer.training:
            return
        group = self.process_groups.group
        assert group is not None
        node = read_node_state(saved, checkpoint_path, group.node_rank, group.num_nodes, group.ranks_per_node)
        checkpoint[RNG_KEY] = node["rng"]  # None where the node wrote no state: it keeps random states of its own
        self._pending_resume = (saved, node)

    def _resume(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Put back what :meth:`load` read: this node's weights and inner optimizer, the outer optimizers and the
        schedule (the model held the checkpoint's global weights when DiLoCo copied them)."""
        if self._pending_resume is None:
            return
        saved, node = self._pending_resume
        self._pending_resume = None
        restore_node_state(node, self.run, model, optimizer)
        self._steps = saved["optimizer_steps"]
        if self.run is not None:
            self.run.load_state_dict(saved, self._steps)

    def close_run(self) -> None:
        """Unhook the optimizer and stop this rank's torchft servers; the model keeps its weights."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super().close_run()
        self._fragments = []
