"""What FastDDPStrategy and FastFSDPStrategy do alike when their nodes train across a world per node (``outer_sync``
or ``replica_groups``): the strategies own the jobs and call these from their own hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_fastdist.strategies.loop_state import align_resumed_batch_count

if TYPE_CHECKING:
    from lightning_fastdist.strategies.ddp import FastDDPStrategy
    from lightning_fastdist.strategies.fsdp import FastFSDPStrategy
    from lightning_fastdist.strategies.outer_sync import OuterSyncJob
    from lightning_fastdist.strategies.replica_groups import ReplicaGroupsJob


def across_nodes_job(strategy: FastDDPStrategy | FastFSDPStrategy) -> OuterSyncJob | ReplicaGroupsJob | None:
    """The job of the form of training across nodes the strategy runs, if any."""
    return strategy.outer_sync or strategy.replica_groups


def training_ranks_of(strategy: FastDDPStrategy | FastFSDPStrategy) -> int:
    """The ranks training now (what SpeedMonitor counts): under a world per node those of the nodes still in."""
    job = across_nodes_job(strategy)
    return job.training_ranks(strategy.world_size) if job is not None else strategy.world_size


def resume_ranks(strategy: FastDDPStrategy | FastFSDPStrategy) -> tuple[int, int]:
    """This rank and the ranks whose random states a checkpoint keeps: the node's under a world per node."""
    if across_nodes_job(strategy) is not None:
        return strategy.local_rank, strategy.num_processes
    return strategy.global_rank, strategy.world_size


def start_across_nodes(strategy: FastDDPStrategy | FastFSDPStrategy) -> None:
    """Start the job across nodes when training starts, after Lightning restored a checkpoint's state (outer_sync puts
    this node's own on top of it), and align the resumed batch count."""
    module = strategy.lightning_module
    assert module is not None
    counting = {"stats": strategy.comm_stats, "clock": strategy.exposed_comm}
    if strategy.outer_sync is not None:
        strategy.outer_sync.start(
            strategy.model,
            module,
            strategy.plan.blocks,
            strategy.optimizers,
            strategy.timeout,
            strategy._resume,
            **counting,
        )
    if strategy.replica_groups is not None:
        strategy.replica_groups.start(strategy.model, module, strategy.optimizers, strategy.timeout, **counting)
    align_resumed_batch_count(module.trainer)
