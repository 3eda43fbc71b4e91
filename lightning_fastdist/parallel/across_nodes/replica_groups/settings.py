"""The options of training every step across nodes that are torchft replica groups, described and checked once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ReplicaGroups:
    """Each node a torchft replica group, the gradients averaged across the nodes every step (``replica_groups`` of
    FastDDPStrategy and FastFSDPStrategy): what one world computes, on a job that trains on when a node is lost.

    Attributes:
        min_nodes: the fewest nodes the job trains on (1 or more, at most the job's nodes). A node lost after the
            start (killed, preempted, its link down) leaves the others training on at the next step, and started
            again with the same command it joins them; with fewer than ``min_nodes`` left no step is applied until
            enough are back (``docs/fault-tolerance.md``).
    """

    min_nodes: int

    def __post_init__(self) -> None:
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int) or self.min_nodes < 1:
            raise ValueError(f"replica_groups.min_nodes={self.min_nodes!r} must be an integer >= 1.")

    @classmethod
    def of(cls, value: ReplicaGroups | Mapping[str, Any] | None) -> ReplicaGroups | None:
        """``value`` as settings: a :class:`ReplicaGroups`, a mapping of its fields (a recipe's), or ``None``."""
        if value is None or isinstance(value, ReplicaGroups):
            return value
        accepted = [f.name for f in fields(cls)]
        if not isinstance(value, Mapping):
            raise ValueError(f"replica_groups must be a mapping of {accepted}, not {value!r}.")
        unknown = sorted(set(value) - set(accepted))
        if unknown:
            raise ValueError(f"replica_groups has no option {unknown[0]!r}: accepted are {accepted}.")
        if "min_nodes" not in value:
            raise ValueError(
                "replica_groups needs min_nodes: the fewest nodes the job trains on (e.g. {min_nodes: 1})."
            )
        return cls(**value)
