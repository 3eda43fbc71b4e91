"""A node restarted while the others train on (``min_nodes``) takes its state from a live node, not from disk.

At the quorum that heals it, an up-to-date node sends what the state-dict functions registered with its torchft
``Manager`` return, over the job's own transport (``state_transport.py``). DiLoCo registers the fragments' global
copies and outer optimizers; ``NodeState`` the rest: weights, inner optimizer, schedule and the training position (the
strategy's: this layer knows no Lightning).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from lightning_fastdist.parallel.fsdp.local_shards import local_part

NODE_STATE_KEY = "lightning_fastdist"  # the name NodeState's functions are registered under, on every node


@dataclass(frozen=True)
class Rejoined:
    """How a restarted node joined the running job.

    Attributes:
        source: the node whose state it received (``node0``).
        step: the optimizer steps the job had taken (the node trains on from the next).
        received_bytes: what torchft's transport received: the tensors of every registered state.
        position: the training position the strategy read on the source node.
        inner_optimizer: the inner optimizer's state as the source held it (an ``optimizer_snapshot``).
    """

    source: str
    step: int
    received_bytes: int
    position: Any
    inner_optimizer: dict[str, Any]


class NodeState:
    """The weights, inner optimizer, schedule and training position of a node, as torchft sends them to a node that
    rejoins (``snapshot`` on the sender, ``receive`` on the node behind).

    Args:
        schedule: returns where DiLoCo's schedule stands (``{"steps", "local_step"}``).
        position: returns the training position (``None`` where nobody reads it).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Callable[[], dict[str, int]],
        position: Callable[[], Any],
    ) -> None:
        # Its parameters now: during a step FSDP registers gathered ones in their place, and torchft snapshots in its
        # own thread while a step runs.
        self.parameters = list(model.parameters())
        self.optimizer = optimizer
        self.schedule = schedule
        self.position = position
        self.received: dict[str, Any] | None = None

    def snapshot(self) -> dict[str, Any]:
        """Copies, not the live tensors: torchft runs this in its quorum thread while training waits in the optimizer
        step's hook, then serves the result to the node behind while training goes on (on CPU its transport sends
        the tensors it was given)."""
        with torch.no_grad():
            weights = [local_part(parameter).detach().clone() for parameter in self.parameters]
        return {
            "weights": weights,
            "optimizer": optimizer_snapshot(self.optimizer),
            "schedule": self.schedule(),
            "position": self.position(),
        }

    def receive(self, state: dict[str, Any]) -> None:
        """Keep a received snapshot (applied by the run once the quorum that healed this node is over)."""
        self.received = state

    def restore(self, received: dict[str, Any]) -> None:
        """Copy a snapshot's weights (this process's shards where sharded) and optimizer state into the node."""
        with torch.no_grad():
            for parameter, saved in zip(self.parameters, received["weights"], strict=True):
                local_part(parameter).copy_(saved)
        load_optimizer_snapshot(self.optimizer, received["optimizer"])


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every tensor copied, a DTensor as its local shard (a DTensor's mesh does not
    travel)."""
    state = optimizer.state_dict()
    copied: dict[Any, dict[str, Any]] = {}
    for index, values in state["state"].items():
        copied[index] = {
            name: local_part(value).detach().clone() if isinstance(value, torch.Tensor) else value
            for name, value in values.items()
        }
    return {"state": copied, "param_groups": state["param_groups"]}


def load_optimizer_snapshot(optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]) -> None:
    """Load ``optimizer_snapshot``'s state into ``optimizer``: a tensor shaped as its parameter's shard becomes a
    DTensor placed as that parameter is (a sharded optimizer keeps DTensor state)."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    state = {
        index: {name: _placed_as(parameters[int(index)], value) for name, value in values.items()}
        for index, values in snapshot["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": snapshot["param_groups"]})


def tensor_bytes_of(tree: Any) -> int:
    """Bytes of the tensors anywhere in ``tree`` (dicts, lists, tuples)."""
    leaves, _ = tree_flatten(tree)
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves if isinstance(leaf, torch.Tensor))


def _placed_as(parameter: torch.Tensor, value: Any) -> Any:
    if not (isinstance(parameter, DTensor) and isinstance(value, torch.Tensor)):
        return value
    if value.shape != parameter.to_local().shape:  # a step count or another scalar: not sharded
        return value
    return DTensor.from_local(
        value, parameter.device_mesh, parameter.placements, shape=parameter.shape, stride=parameter.stride()
    )
