"""What FastDDPStrategy and FastFSDPStrategy do differently with ``replica_groups``: one torch.distributed world per
node, gradients averaged across the nodes every step through torchft, a lost node left out and a restarted one taken
back.

The processes that talk across nodes are each node's local rank 0 under DDP (the link carries the gradients once per
node) and every rank under FSDP (with the same shard's ranks on the other nodes). The gradients are averaged across
nodes inside Lightning's closure, so clipping and ``on_before_optimizer_step`` see them as in one world; a step that
did not commit leaves every gradient ``None`` and the optimizer skips it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_fastdist.parallel.replica_groups.every_step import OPTION, EveryStepRun
from lightning_fastdist.parallel.replica_groups.gradients import FlatGradients, FlatTensors
from lightning_fastdist.parallel.replica_groups.group import is_first_node
from lightning_fastdist.parallel.replica_groups.rejoin import load_optimizer_snapshot
from lightning_fastdist.parallel.replica_groups.settings import ReplicaGroups
from lightning_fastdist.strategies.loop_state import continue_after, training_position
from lightning_fastdist.strategies.node_worlds import NodeWorlds, broadcast_in_node, decide_in_node, share_in_node


class ReplicaGroupsJob:
    """Training every step across nodes that are torchft replica groups (``owner`` names the strategy in errors;
    ``broadcast_buffers``: the buffers are node 0's at every step, as DDP's ``broadcast_buffers`` makes them rank 0's;
    ``sharded``: each rank of a node holds a shard of the weights, as under FSDP)."""

    def __init__(
        self, settings: ReplicaGroups, owner: str, broadcast_buffers: bool = True, sharded: bool = False
    ) -> None:
        self.settings = settings
        self.owner = owner
        self.broadcast_buffers = broadcast_buffers
        self.sharded = sharded
        self.nodes = NodeWorlds(owner, OPTION, settings.min_nodes, sharded)
        self.run: EveryStepRun | None = None  # where this process talks across nodes, while fitting
        self._gradients: FlatGradients | None = None  # while fitting
        self._buffers: FlatTensors | None = None  # while fitting, where the model has buffers DDP would broadcast
        self.wrote_last_checkpoint = False  # whether this node wrote the latest checkpoint (writes_checkpoints)

    def check_launch(self, num_nodes: int) -> None:
        """Refuse, before any process starts, one node, more ``min_nodes`` than nodes, or no torchft."""
        self.nodes.check_launch(num_nodes, f"remove {OPTION}")

    def start(
        self,
        model: nn.Module,
        module: pl.LightningModule,
        optimizers: Sequence[torch.optim.Optimizer],
        timeout: timedelta,
        **counting: Any,
    ) -> None:
        """Start this node's side of the job when training starts (after Lightning restored a checkpoint's state):
        the weights made equal across nodes, or on a node restarted while the others train theirs taken."""
        if not module.automatic_optimization or len(optimizers) != 1:
            raise ValueError(
                f"{self.owner}: {OPTION} averages the gradients of Lightning's automatic optimization, one optimizer, "
                "and this LightningModule steps its optimizers itself: remove replica_groups (or use outer_sync "
                "with min_nodes, which hooks any single optimizer's step)."
            )
        self.close_run()  # a second fit in the same process starts afresh
        group = self.nodes.group_of_this_fit()
        self._gradients = FlatGradients([p for p in model.parameters() if p.requires_grad])
        buffers = [buffer for buffer in model.buffers() if buffer.dtype != torch.bool]
        self._buffers = FlatTensors(buffers) if buffers and self.broadcast_buffers else None
        if group.talks_across_nodes:
            report = _warn if group.local_rank == 0 else None  # once per node
            self.run = EveryStepRun(model, optimizers[0], group, timeout, report=report, **counting)
        rejoined = self.run.rejoined if self.run is not None else None
        if not self.sharded:
            rejoined = share_in_node(rejoined)
            broadcast_in_node([*model.parameters(), *buffers])  # the weights and buffers local rank 0 agreed on
        if rejoined is not None:
            if self.run is None:  # local rank 0 loaded it; its weights came with the broadcast above
                load_optimizer_snapshot(optimizers[0], rejoined.inner_optimizer)
            continue_after(module.trainer, rejoined.position, rejoined.step)

    def before_batch(self) -> None:
        """Start the step's quorum (it overlaps the forward and backward)."""
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

    def reduce_across_nodes(self, tensor: torch.Tensor, reduce_op: Any) -> torch.Tensor:
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

    def after_step(self, trainer: pl.Trainer) -> None:
        """Keep where training stands after this step: what a node that rejoins at the next one receives."""
        if self.run is not None:
            self.run.position = training_position(trainer)

    def writes_checkpoints(self, node_rank: int) -> bool:
        """Whether this node writes the checkpoint being saved: the first node of the latest quorum (node 0 before
        any), so that checkpoints go on while node 0 is away. Under DDP only local rank 0 knows the quorum: call on
        every rank of the node (it shares the answer)."""
        quorum_nodes = self.run.membership.quorum_nodes if self.run is not None else ()
        self.wrote_last_checkpoint = share_in_node(is_first_node(quorum_nodes, node_rank))
        return self.wrote_last_checkpoint

    def training_ranks(self, world_size: int) -> int:
        """The ranks of the nodes in the latest quorum (known on each node's local rank 0), else ``world_size``."""
        quorum_nodes = self.run.membership.quorum_nodes if self.run is not None else ()
        return self.nodes.training_ranks(quorum_nodes, world_size)

    def close_run(self) -> None:
        """Stop this process's torchft servers."""
        if self.run is not None:
            self.run.close()
            self.run = None
        self.nodes.close_fit()

    def teardown(self) -> None:
        """Stop torchft's servers of this process (the lighthouse on global rank 0)."""
        self.close_run()
        self.nodes.stop_lighthouse()


def _reducing_across_nodes(job: ReplicaGroupsJob | None, module: pl.LightningModule | None) -> ReplicaGroupsJob | None:
    """``job``, where Lightning's reductions go on across the nodes now: while training, and not while a node stops on
    a signal (it saves alone: the others are not at that reduction). While evaluating, every node sees the same
    weights and all of the data: the nodes reduce alike without crossing."""
    if job is None or module is None:
        return None
    trainer = module.trainer
    return job if trainer.training and not trainer.received_sigterm else None


def on_across_nodes(
    job: ReplicaGroupsJob | None, module: pl.LightningModule | None, reduced: Any, reduce_op: Any
) -> Any:
    """``reduced`` (a tensor Lightning reduced over the node's ranks with ``reduce_op``, or anything else) reduced on
    across the nodes while training under ``job``, as one world would have reduced it; else as it is."""
    replicas = _reducing_across_nodes(job, module)
    if replicas is None or not isinstance(reduced, torch.Tensor):
        return reduced
    return replicas.reduce_across_nodes(reduced, reduce_op)


def decide_across_nodes(
    job: ReplicaGroupsJob | None,
    module: pl.LightningModule | None,
    decision: bool,
    all: bool,  # noqa: A002 - Lightning's name
    device: torch.device,
) -> bool:
    """Lightning's ``reduce_boolean_decision`` with a world per node: over the node's ranks, and while training under
    ``job`` over every node's (each rank decides on its own training metrics)."""
    replicas = _reducing_across_nodes(job, module)
    across = functools.partial(replicas.reduce_across_nodes, reduce_op="sum") if replicas is not None else None
    return decide_in_node(decision, all, device, across)


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


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=2)
