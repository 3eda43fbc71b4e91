"""One node's side of training every step across nodes that are torchft replica groups.

Inside a node gradients are averaged as usual (DDP); across nodes local rank 0 runs torchft's ``Manager`` with an
asynchronous quorum that overlaps the forward and backward. The step is applied only where ``should_commit`` says
every all-reduce succeeded. A node behind the quorum (restarted, or one that missed a commit) heals in it: a live node
sends it its state (``rejoin``), it sends zeros into that step's all-reduce and steps with the others' average.
One private torchft name is read: the state a healing node received, before its step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lightning_fastdist.parallel.across_nodes.group import ReplicaGroup
from lightning_fastdist.parallel.across_nodes.node_run import NodeRun
from lightning_fastdist.parallel.across_nodes.rejoin import NODE_STATE_KEY, NodeState
from lightning_fastdist.parallel.comm.accounting import CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, TimedWork

ACROSS_NODES = "replica_allreduce"  # logged as comm/replica_allreduce_bytes_per_step
OPTION = "replica_groups"


class EveryStepRun(NodeRun):
    """torchft's ``Manager`` for the process that talks across nodes for its node (its local rank 0), or for its shard.

    Args:
        model: its weights are made equal across nodes (node 0's), and sent to a node that heals, as is the
            optimizer's state.
        timeout: for torchft's collectives and quorums.
        stats: the all-reduces across nodes are recorded as ``ACROSS_NODES``.
        report: called with the lines saying which nodes left or came back, and which steps were not applied.

    Attributes:
        position: the training position after the latest step (the strategy sets it), sent to a node that rejoins.
        skipped: the steps that did not commit on this node.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        group: ReplicaGroup,
        timeout: timedelta,
        stats: CommStats | None = None,
        clock: ExposedCommClock | None = None,
        report: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__(group, timeout, OPTION, "the step's quorum", async_quorum=True, report=report)
        self._stats = stats
        self._clock = clock
        self._report = report
        self.position: Any = None
        self.skipped: list[int] = []
        self._node_state = NodeState(model, optimizer, lambda: {"steps": self.steps}, lambda: self.position)
        self.serve_state(self._node_state)
        self._quorum_started = False
        if self.joining:
            self._rejoin()
        else:
            self.start_with_equal_weights(model, timeout)

    def _rejoin(self) -> None:
        """Join nodes that are training: wait for the quorum of their next step (this node's first), in which torchft
        gives this node a live node's state; take the weights and optimizer state now (the strategy sets the
        training position from ``rejoined``)."""
        self.start_step()
        self.wait_to_be_taken_back()
        pending = self.manager._pending_state_dict  # applied by torchft only at should_commit, after the forward
        if pending is None:
            raise RuntimeError(
                f"{OPTION}: node{self.group.node_rank} started while the other nodes train and received no state from "
                f"them ({self.manager.errored() or 'they had not taken a step yet'}): restart the whole job, or start "
                "this node again."
            )
        received = pending["user"][NODE_STATE_KEY]
        self._node_state.restore(received)
        self.steps = received["schedule"]["steps"]
        self.rejoined = self.rejoined_with(received)
        if self._report is not None:
            held = "local rank 0's shard: " if self.group.sharded else ""
            self._report(
                f"{OPTION}: node{self.group.node_rank} rejoined the job at step {self.steps} with the weights and "
                f"optimizer state of {self.rejoined.source} ({held}{self.rejoined.received_bytes:,} bytes from its "
                f"memory, not from a checkpoint): its batch of step {self.steps + 1} is not trained (torchft counts a "
                "node that heals out of that step), it trains on from the next."
            )

    def start_step(self) -> None:
        """Start the quorum of the next optimizer step, once (call at each batch's start: under gradient
        accumulation the first batch of the step starts it)."""
        if not self._quorum_started:
            self.manager.start_quorum()
            self._quorum_started = True

    def average(self, flats: Sequence[torch.Tensor], first_node: Sequence[torch.Tensor] = ()) -> bool:
        """Average ``flats`` (this node's gradients, flattened) over this step's quorum in place, give ``first_node``
        (the model's buffers, flattened) the quorum's first node's values (as DDP broadcasts rank 0's), and return
        whether the step commits (every all-reduce succeeded and the quorum holds ``min_nodes``)."""
        self.start_step()
        works = [self._all_reduce(flat, torch.distributed.ReduceOp.AVG) for flat in flats]
        if first_node and self.manager.participating_rank() != 0:
            for flat in first_node:
                flat.zero_()
        works += [self._all_reduce(flat, torch.distributed.ReduceOp.SUM) for flat in first_node]
        for work in works:
            work.wait()
        committed = self.manager.should_commit()  # where this node heals, torchft gives it the state here
        self._quorum_started = False
        self.steps += 1
        received, self._node_state.received = self._node_state.received, None
        if received is not None:  # again on a restarted node's first step: the same state, its weights unchanged since
            self._node_state.restore(received)
        if not committed:
            self.skipped.append(self.steps)
            if self._report is not None:
                self._report(
                    f"{OPTION}: step {self.steps} is not applied on node{self.group.node_rank} "
                    f"({self._why_not_committed()}): no weight moved; training goes on from the next step."
                )
        return committed

    def reduce(self, tensor: torch.Tensor, op: torch.distributed.ReduceOp.RedOpType) -> torch.Tensor:
        """``tensor`` reduced with ``op`` over the nodes of the latest quorum, in place (a healing node sends zeros, and
        an average does not count it). Between two steps that is the quorum of the step just taken: the next step's
        may bring in a node that did not take it."""
        self.manager.allreduce(tensor, reduce_op=op).wait()
        return tensor

    def _why_not_committed(self) -> str:
        error = self.manager.errored()
        if error is None:
            return f"its quorum held fewer than min_nodes={self.group.min_nodes} nodes taking part"
        cause = str(getattr(error, "original_exception", error)).split(". ")[0]
        return f"a node was lost during its all-reduce: {cause}"

    def _all_reduce(self, flat: torch.Tensor, op: torch.distributed.ReduceOp.RedOpType) -> Any:
        if self._stats is not None:
            self._stats.record(flat, ACROSS_NODES)
        work = self.manager.allreduce(flat, reduce_op=op)
        return TimedWork(work, self._clock) if self._clock is not None else work
