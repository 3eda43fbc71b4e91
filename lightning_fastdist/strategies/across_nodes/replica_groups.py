"""``replica_groups``: one torch.distributed world per node, the gradients averaged across the nodes every step
through torchft, a lost node left out and a restarted one taken back.

The processes that talk across nodes are each node's local rank 0 under DDP (the link carries the gradients once per
node) and every rank under FSDP (with the same shard's ranks on the other nodes). The gradients are averaged across
nodes inside Lightning's closure, so clipping and ``on_before_optimizer_step`` see them as in one world; a step that
did not commit leaves every gradient ``None`` and the optimizer skips it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_fastdist.parallel.across_nodes.group import ReplicaGroup, is_first_node
from lightning_fastdist.parallel.across_nodes.replica_groups.gradients import FlatGradients, FlatTensors
from lightning_fastdist.parallel.across_nodes.replica_groups.run import ACROSS_NODES, OPTION, EveryStepRun
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.parallel.gradients.trainable import TrainableSet
from lightning_fastdist.strategies.across_nodes.interface import TrainingStart
from lightning_fastdist.strategies.across_nodes.node_process_groups import broadcast_in_node, share_in_node
from lightning_fastdist.strategies.across_nodes.torchft_form import TorchftForm
from lightning_fastdist.trainer.loop_state import training_position


class ReplicaGroupsJob(TorchftForm):
    """Training every step across nodes that are torchft replica groups (``owner`` names the strategy in errors;
    ``broadcast_buffers``: the buffers are node 0's at every step, as DDP's ``broadcast_buffers`` makes them rank 0's;
    ``sharded``: each rank of a node holds a shard of the weights, as under FSDP)."""

    powersgd_refusal = "under replica_groups each node is a world of its own, and inside it"
    hsdp_refusal = "replica_groups replicates across nodes through torchft, as sharding='hsdp' does through one world"
    collectives = (ACROSS_NODES,)
    settings: ReplicaGroups

    def __init__(
        self, settings: ReplicaGroups, owner: str, broadcast_buffers: bool = True, sharded: bool = False
    ) -> None:
        super().__init__(settings, owner, sharded)
        self.broadcast_buffers = broadcast_buffers
        self._gradients: FlatGradients | None = None  # while fitting
        self._model: nn.Module | None = None  # while fitting
        self._trainable = TrainableSet(nn.Module())  # the parameters whose gradients cross nodes
        self._buffers: FlatTensors | None = None  # while fitting, where the model has buffers DDP would broadcast

    def _check_optimizers(self, training: TrainingStart) -> None:
        if not training.module.automatic_optimization or len(training.optimizers) != 1:
            raise ValueError(
                f"{self.owner}: {OPTION} averages the gradients of Lightning's automatic optimization, one optimizer, "
                "and this LightningModule steps its optimizers itself: remove replica_groups (or use outer_sync "
                "with min_nodes, which hooks any single optimizer's step)."
            )

    def _prepare(self, training: TrainingStart) -> None:
        model = training.model
        self._model, self._trainable = model, TrainableSet(model)
        self._gradients = FlatGradients([p for p in model.parameters() if p.requires_grad])
        buffers = self._synced_buffers(model)
        self._buffers = FlatTensors(buffers) if buffers and self.broadcast_buffers else None

    @staticmethod
    def _synced_buffers(model: nn.Module) -> list[torch.Tensor]:
        return [buffer for buffer in model.buffers() if buffer.dtype != torch.bool]  # gloo sums no booleans

    def _new_run(
        self, training: TrainingStart, group: ReplicaGroup, report: Callable[[str], None] | None
    ) -> EveryStepRun:
        model, optimizer = training.model, training.optimizers[0]
        return EveryStepRun(model, optimizer, group, training.timeout, training.stats, training.clock, report)

    def _shared_in_node(self, model: nn.Module) -> list[torch.Tensor]:
        """The weights and buffers local rank 0 agreed on with the other nodes."""
        return [*model.parameters(), *self._synced_buffers(model)]

    def before_batch(self) -> None:
        """Start the step's quorum (it overlaps the forward and backward); where a callback froze or unfroze parameters
        since (``BackboneFinetuning``), the gradients sent across nodes follow."""
        if self._model is not None and self._trainable.changed(self._model) is not None:
            self._gradients = FlatGradients([p for p in self._model.parameters() if p.requires_grad])
        if self.run is not None:
            self.run.start_step()

    def averaging_after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's ``closure`` (forward and backward), then the gradients averaged across the nodes."""

        def closure_then_average() -> Any:
            loss = closure()
            self._average()
            return loss

        return closure_then_average

    def _average(self) -> None:
        assert self._gradients is not None, "start first"
        flats = self._gradients.gather()
        buffers = self._buffers.gather() if self._buffers is not None else []
        if self.sharded:  # every rank averages its own shard with the same shard's ranks on the other nodes
            assert self.run is not None
            committed = self.run.average(flats, buffers)  # torchft's commit is agreed by every rank of the node
        else:
            decision = torch.ones(1, device=flats[0].device)
            if self.run is not None:
                decision.fill_(float(self.run.average(flats, buffers)))
            broadcast_in_node([*flats, *buffers, decision])
            committed = bool(decision.item())
        self._gradients.scatter(apply=committed)
        if self._buffers is not None:
            self._buffers.scatter()

    def after_step(self, trainer: pl.Trainer) -> None:
        """Keep where training stands after this step: what a node that rejoins at the next one receives."""
        if self.run is not None:
            self.run.position = training_position(trainer)

    def reduce(self, module: pl.LightningModule | None, reduced: Any, reduce_op: Any) -> Any:
        """While training, ``reduced`` (a tensor Lightning reduced over the node's ranks with ``reduce_op``) reduced on
        across the nodes, as one world would have reduced it."""
        if not self._crosses_nodes(module) or not isinstance(reduced, torch.Tensor):
            return reduced
        return self._reduce_across_nodes(reduced, reduce_op)

    def _summed_across_nodes(self, module: pl.LightningModule | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """While training: each rank decides on its own training metrics, so a decision counts every node's ranks."""
        if not self._crosses_nodes(module):
            return None
        return functools.partial(self._reduce_across_nodes, reduce_op="sum")

    def _crosses_nodes(self, module: pl.LightningModule | None) -> bool:
        """Whether Lightning's reductions go on across the nodes now: while training, and not while a node stops on a
        signal (it saves alone: the others are not at that reduction). While evaluating, every node sees the same
        weights and all of the data: the nodes reduce alike without crossing."""
        if module is None:
            return False
        trainer = module.trainer
        return trainer.training and not trainer.received_sigterm

    def _reduce_across_nodes(self, tensor: torch.Tensor, reduce_op: Any) -> torch.Tensor:
        """Take ``tensor``, reduced over the node's ranks with Lightning's ``reduce_op`` (``"mean"``, ``"sum"``,
        ``"max"``, ``"min"``, a ``ReduceOp``; ``None`` sums), on across the nodes training, as one world would
        reduce it (each node has as many ranks). Call on every rank of the node, while training."""
        op = _REDUCE_OPS.get(reduce_op.lower() if isinstance(reduce_op, str) else reduce_op)
        if op is None:
            raise ValueError(f"{self.owner}: reduce_op={reduce_op!r} is not one of {sorted(map(str, _REDUCE_OPS))}.")
        if op == dist.ReduceOp.AVG and not torch.is_floating_point(tensor):
            tensor = tensor.float()
        if self.run is not None:
            self.run.reduce(tensor, op)
        if not self.sharded:  # every rank reduced it with its peers on the other nodes
            broadcast_in_node([tensor])
        return tensor

    def writes_checkpoint(self, node_rank: int) -> bool:
        """The first node of the latest quorum (node 0 before any) writes, so that checkpoints go on while node 0 is
        away; the nodes hold the same state. Under DDP only local rank 0 knows the quorum: it shares the answer."""
        quorum_nodes = self.run.membership.quorum_nodes if self.run is not None else ()
        self.wrote_last_checkpoint = share_in_node(is_first_node(quorum_nodes, node_rank))
        return self.wrote_last_checkpoint


# Lightning's reduce_op spellings (its DDPStrategy.reduce; None sums), as torchft's all-reduce takes them.
_REDUCE_OPS: dict[Any, dist.ReduceOp.RedOpType] = {
    None: dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.AVG,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    dist.ReduceOp.SUM: dist.ReduceOp.SUM,
    dist.ReduceOp.AVG: dist.ReduceOp.AVG,
    dist.ReduceOp.MAX: dist.ReduceOp.MAX,
    dist.ReduceOp.MIN: dist.ReduceOp.MIN,
}
