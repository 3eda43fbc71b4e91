"""Training across nodes, the Lightning side: what a strategy does about nodes, one object whichever form is on.

A strategy holds what :func:`across_nodes` returns, an :class:`AcrossNodes`, and calls it from its own hooks:
:class:`OneWorld` (one torch.distributed world holds every rank: Lightning's behaviour), or one of the two forms on
torchft, whose base is :class:`TorchftForm` (each node a replica group with :class:`NodeProcessGroups` of its own):
:class:`OuterSyncJob` (``outer_sync``: DiLoCo every ``every`` steps) and :class:`ReplicaGroupsJob`
(``replica_groups``: the gradients averaged across nodes every step). The torch side of both is
``parallel/across_nodes/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.parallel.plan.parallel_plan import BlocksOption
from lightning_fastdist.strategies.across_nodes.interface import AcrossNodes, OneWorld, TrainingStart
from lightning_fastdist.strategies.across_nodes.outer_sync import OuterSyncJob
from lightning_fastdist.strategies.across_nodes.replica_groups import ReplicaGroupsJob
from lightning_fastdist.strategies.across_nodes.torchft_form import TorchftForm

__all__ = [
    "AcrossNodes",
    "OneWorld",
    "OuterSyncJob",
    "ReplicaGroupsJob",
    "TorchftForm",
    "TrainingStart",
    "across_nodes",
]


def across_nodes(
    outer_sync: OuterSync | Mapping[str, Any] | None,
    replica_groups: ReplicaGroups | Mapping[str, Any] | None,
    owner: str,
    blocks: BlocksOption,
    sharded: bool = False,
    broadcast_buffers: bool = True,
) -> AcrossNodes:
    """The across-nodes object of a strategy's ``outer_sync`` and ``replica_groups`` options (a settings object or a
    recipe's mapping each; at most one given). Raises the options' one-line ``ValueError``."""
    outer = OuterSync.of(outer_sync)
    replicas = ReplicaGroups.of(replica_groups)
    if outer is not None and replicas is not None:
        raise ValueError(
            "outer_sync and replica_groups are two forms of training across nodes: give one (a lost node is left out "
            "under outer_sync with its own min_nodes)."
        )
    if outer is not None:
        return OuterSyncJob(outer, owner, blocks, sharded)
    if replicas is not None:
        return ReplicaGroupsJob(replicas, owner, broadcast_buffers, sharded)
    return OneWorld()
