"""The options of training every step across nodes that are torchft replica groups, described and checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lightning_fastdist.parallel.across_nodes.form_settings import FormSettings


@dataclass(frozen=True)
class ReplicaGroups(FormSettings):
    """Each node a torchft replica group, the gradients averaged across the nodes every step (``replica_groups`` of
    FastDDPStrategy and FastFSDPStrategy): what one world computes, on a job that trains on when a node is lost.

    Attributes:
        min_nodes: the fewest nodes the job trains on (1 or more, at most the job's nodes). A node lost after the
            start (killed, preempted, its link down) leaves the others training on at the next step, and started
            again with the same command it joins them; with fewer than ``min_nodes`` left no step is applied until
            enough are back (``docs/fault-tolerance.md``).
    """

    option: ClassVar[str] = "replica_groups"
    required: ClassVar[dict[str, str]] = {"min_nodes": "the fewest nodes the job trains on (e.g. {min_nodes: 1})"}

    min_nodes: int

    def __post_init__(self) -> None:
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int) or self.min_nodes < 1:
            raise ValueError(f"replica_groups.min_nodes={self.min_nodes!r} must be an integer >= 1.")
