"""What a strategy with ``outer_sync`` does differently: one torch.distributed world per node, DiLoCo across them.

torchft's ``DiLoCo`` hooks the optimizer's ``step`` on each process that talks across nodes. Under DDP that is each
node's local rank 0, so the slow link carries each pseudo-gradient once per node, and it broadcasts each fragment
after its outer step to the node's other ranks on fast links. Under FSDP every rank talks to the ranks holding the
same shard on the other nodes, and nothing is broadcast. Evaluation and the weights after fit are the global ones,
the same on every node; a node restarted while the others train (``min_nodes``) takes a live node's state.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_fastdist.parallel.plan.blocks import outermost_block_modules, resolve_blocks
from lightning_fastdist.parallel.plan.parallel_plan import BlocksOption
from lightning_fastdist.parallel.replica_groups.group import ReplicaGroup
from lightning_fastdist.parallel.replica_groups.rejoin import load_optimizer_snapshot
from lightning_fastdist.parallel.semi_sync.fragments import split_into_fragments
from lightning_fastdist.parallel.semi_sync.settings import OuterSync
from lightning_fastdist.parallel.semi_sync.torchft_run import OuterSyncRun
from lightning_fastdist.strategies.exact_resume import RNG_KEY, ResumeState
from lightning_fastdist.strategies.loop_state import continue_after, training_position
from lightning_fastdist.strategies.node_worlds import NodeWorlds, broadcast_in_node, share_in_node
from lightning_fastdist.strategies.outer_sync_checkpoint import (
    CHECKPOINT_KEY,
    read_node_state,
    restore_node_state,
    save_node_state,
)


class OuterSyncJob:
    """The outer synchronisation of one strategy (``owner`` names it in errors; ``sharded``: each rank of a node holds
    a shard of the weights, as under FSDP, instead of all of them)."""

    def __init__(self, settings: OuterSync, owner: str, sharded: bool = False) -> None:
        self.settings = settings
        self.owner = owner
        self.sharded = sharded
        self.nodes = NodeWorlds(owner, "outer_sync", settings.min_nodes, sharded)
        self.run: OuterSyncRun | None = None  # where this process talks across nodes, while fitting
        self._fragments: list[nn.Module] = []
        self._steps = 0  # optimizer steps of this fit (the schedule's clock on every rank)
        self._hook: Any = None
        self._own_weights: list[torch.Tensor] | None = None
        self.fragment_numels: list[int] = []  # elements of each fragment, once fitting started
        self._pending_resume: tuple[dict, dict] | None = None

    @property
    def group(self) -> ReplicaGroup | None:
        """Where this process's node stands in the job (once joined)."""
        return self.nodes.group

    def check_launch(self, num_nodes: int) -> None:
        """Refuse, before any process starts, one node, more ``min_nodes`` than nodes, or no torchft."""
        self.nodes.check_launch(num_nodes, "remove outer_sync (inside a node every step is synchronous)")

    def check_fragments(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """Raise the one-line ``ValueError`` of ``fragments`` that do not divide ``model``'s blocks."""
        split_into_fragments(model, blocks, self.settings.fragments)

    def start(
        self,
        model: nn.Module,
        module: pl.LightningModule,
        blocks: BlocksOption,
        optimizers: Sequence[torch.optim.Optimizer],
        timeout: timedelta,
        resume: ResumeState,
        **counting: Any,
    ) -> None:
        """Hook the one optimizer's ``step`` with DiLoCo (after the weights are made equal across nodes), and put back
        what :meth:`load` read (this node's random states into ``resume``). Call when training starts, after Lightning
        restored the checkpoint's own state: loading an optimizer's state may step it, which DiLoCo would count.

        Args:
            model: the model as trained (wrapped or sharded); ``module``'s ``blocks`` are split into fragments.
        """
        if len(optimizers) != 1:
            raise ValueError(
                f"{self.owner}: outer_sync steps one optimizer and configure_optimizers returned {len(optimizers)}: "
                "return one optimizer, or remove outer_sync."
            )
        self.close_run()  # a second fit in the same process starts afresh
        group = self.nodes.group_of_this_fit()
        block_modules = outermost_block_modules(module, resolve_blocks(module, blocks))
        self._fragments = split_into_fragments(model, block_modules, self.settings.fragments)
        self.fragment_numels = [sum(p.numel() for p in fragment.parameters()) for fragment in self._fragments]
        trainer = module.trainer
        if group.talks_across_nodes:
            self.run = OuterSyncRun(
                self.settings,
                model,
                self._fragments,
                optimizers[0],
                group,
                timeout,
                report=_warn if group.local_rank == 0 else None,  # once per node
                position=functools.partial(training_position, trainer),
                **counting,
            )
        rejoined = self.run.rejoined if self.run is not None else None
        if not self.sharded:  # under DDP local rank 0 received a live node's state, and tells the others
            rejoined = share_in_node(rejoined)
            broadcast_in_node(model.parameters())  # the weights local rank 0 agreed on with the other nodes
            self._hook = optimizers[0].register_step_post_hook(self._after_step)  # runs after DiLoCo's own
        self._steps = 0
        if rejoined is not None:  # a live node's state, newer than any checkpoint this fit was given
            self._pending_resume = None
            if self.run is None:  # under DDP local rank 0 loaded it; its weights came with the broadcast above
                load_optimizer_snapshot(optimizers[0], rejoined.inner_optimizer)
            self._steps = rejoined.step
            continue_after(trainer, rejoined.position, rejoined.step)
            return
        node_rng = self._resume(model, optimizers[0])
        if node_rng is not None:
            resume.take_from(node_rng, self.group.local_rank, self.group.ranks_per_node)

    def _after_step(self, *_: Any) -> None:
        """After each optimizer step that applied a fragment's outer step, local rank 0 tells the node's other ranks
        which fragment (DiLoCo retries one whose all-reduce failed) through the node's store (host only: no device
        sync), then sends them its weights."""
        self._steps += 1
        if self._steps % self.settings.steps_between_fragments or dist.get_world_size() == 1:
            return
        store = self.nodes.store
        assert store is not None
        key = f"applied/{self._steps}"
        if self.run is not None:
            store.set(key, str(self.run.fragment_due))
        fragment = int(store.get(key))
        broadcast_in_node(self._fragments[fragment].parameters())
        if self.run is not None:  # every other rank read it before joining the broadcast
            store.delete_key(key)

    def training_ranks(self, world_size: int) -> int:
        """The ranks of the nodes in the latest quorum (known where this process talks across nodes), else
        ``world_size``."""
        quorum_nodes = self.run.membership.quorum_nodes if self.run is not None else ()
        return self.nodes.training_ranks(quorum_nodes, world_size)

    def evaluate_on_global_weights(self, model: nn.Module) -> None:
        """Give ``model`` the global weights (under DDP local rank 0 holds them and sends them to the node's other
        ranks), keeping a copy of this rank's own for :meth:`back_to_own_weights`. Call on every rank of the node."""
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
        if self._own_weights is None:
            return
        with torch.no_grad():
            for parameter, own in zip(model.parameters(), self._own_weights):
                parameter.copy_(own)
        self._own_weights = None

    @contextmanager
    def global_weights(self, model: nn.Module) -> Generator[None, None, None]:
        """Inside, ``model`` holds the global weights; this node's own are put back on leaving (unless it already held
        the global ones: a checkpoint written during validation)."""
        swapping = self._own_weights is None
        if swapping:
            self.evaluate_on_global_weights(model)
        try:
            yield
        finally:
            if swapping:
                self.back_to_own_weights(model)

    def save(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        checkpoint: dict[str, Any],
        filepath: Any,
        optimizer_steps: int,
        stopping: bool = False,
    ) -> None:
        """While fitting, write this node's own state beside ``filepath`` and the shared part into ``checkpoint``.

        A checkpoint written on a stop signal holds the global weights only, marked as such: each node stops on its
        own (the nodes do not agree on a step yet), so a wait for the others could wait forever."""
        if stopping and "loops" in checkpoint:
            checkpoint[CHECKPOINT_KEY] = {"written_on_stop": True}
        elif self._fragments and "loops" in checkpoint:
            assert self.group is not None
            save_node_state(
                self.group,
                self.run,
                model,
                optimizers[0],
                checkpoint,
                filepath,
                checkpoint.get(RNG_KEY),
                optimizer_steps,
            )

    def load(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """Read this node's own state of a checkpoint a fit resumes from (refusing one that cannot resume exactly);
        applied by :meth:`start`. A checkpoint of a run without outer_sync starts it afresh from its weights."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return
        group = self.group
        assert group is not None
        node = read_node_state(saved, checkpoint_path, group.node_rank, group.num_nodes, group.ranks_per_node)
        self._pending_resume = (saved, node)

    def _resume(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Put back what :meth:`load` read: this node's weights and inner optimizer, the outer optimizers and the
        schedule (the model held the checkpoint's global weights when DiLoCo copied them)."""
        if self._pending_resume is None:
            return None
        saved, node = self._pending_resume
        self._pending_resume = None
        restore_node_state(node, self.run, model, optimizer)
        self._steps = saved["optimizer_steps"]
        if self.run is not None:
            self.run.load_state_dict(saved, self._steps)
        return {RNG_KEY: node["rng"]} if node["rng"] is not None else None

    def finish(self, model: nn.Module) -> None:
        """After fit: the model keeps the global weights (what every node agrees on)."""
        if self._fragments:
            self._load_global_weights(model)

    def close_run(self) -> None:
        """Unhook the optimizer and stop this rank's torchft servers; the model keeps its weights."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.run is not None:
            self.run.close()
            self.run = None
        self.nodes.close_fit()
        self._fragments = []

    def teardown(self) -> None:
        """Stop torchft's servers of this process (the lighthouse on global rank 0)."""
        self.close_run()
        self.nodes.stop_lighthouse()


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=2)
