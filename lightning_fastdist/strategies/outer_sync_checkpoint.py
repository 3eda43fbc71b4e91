"""``outer_sync`` in checkpoints: what the nodes share in the checkpoint, what each node alone holds beside it.

Between two outer syncs every node has weights, an inner optimizer state and random states of its own. The
checkpoint global rank 0 publishes holds what the nodes share: the global weights (its ``state_dict``, so it loads
into a plain model as what the nodes agreed on), the outer optimizers' momentum and torchft's step count, under
:data:`CHECKPOINT_KEY`. Each node's local rank 0 writes its own to ``<checkpoint>.outer_sync/nodeNNNNN.pt``
(staged and renamed) before that, and waits for the other nodes' (a barrier across nodes) before global rank 0
publishes. A resume reads its node's file and puts its weights, inner optimizer and random states back when
training starts (after Lightning restored the checkpoint's own), so the run goes on bit for bit.

A checkpoint written while a fragment's all-reduce is in flight (the ``delay`` steps before it is applied) cannot
resume exactly (the all-reduce's result is not in it), nor can one written on a stop signal (the global weights
only: the nodes stop on their own): resuming a fit from either is refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import fsspec
import torch
from torch import nn

from lightning_fastdist.parallel.checkpoint.atomic import is_local_path
from lightning_fastdist.parallel.semi_sync.torchft_run import OuterSyncRun, ReplicaGroup
from lightning_fastdist.strategies.side_files import read_side_file, write_side_file

CHECKPOINT_KEY = "fast_outer_sync"
NODES_SUFFIX = ".outer_sync"  # the folder beside a checkpoint that holds each node's own state
_NODE_FILE = re.compile(r"node(\d{5})\.pt")


def node_file(checkpoint_path: Any, node: int, follow_link: bool = False) -> str:
    """Where node ``node``'s state of the checkpoint at ``checkpoint_path`` lives (beside the file a link names)."""
    path = str(checkpoint_path)
    if follow_link and is_local_path(path):
        path = str(Path(path).resolve())
    return f"{path}{NODES_SUFFIX}/node{node:05d}.pt"


def save_node_state(
    group: ReplicaGroup,
    run: OuterSyncRun | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint: dict[str, Any],
    filepath: Any,
    node_rank_states: list | None,
    optimizer_steps: int,
) -> None:
    """Write this node's own state beside ``filepath`` (on its local rank 0) and the shared part into
    ``checkpoint``; call on every rank of every node, before rank 0 publishes ``checkpoint``.

    Args:
        group: where this rank stands in the job.
        run: the outer synchronisation (on each node's local rank 0; ``None`` on the others).
        node_rank_states: the random states of this node's ranks (gathered on its local rank 0), else ``None``.
        optimizer_steps: the steps trained when saving.
    """
    if run is not None:
        state = {
            "node": group.node_rank,
            "optimizer_steps": optimizer_steps,
            "weights": [p.detach().to("cpu", copy=True) for p in model.parameters()],
            "inner_optimizer": optimizer.state_dict(),
            "rng": node_rank_states,
        }
        write_side_file(state, node_file(filepath, group.node_rank))
        checkpoint[CHECKPOINT_KEY] = {
            **run.state_dict(),
            "num_nodes": group.num_nodes,
            "optimizer_steps": optimizer_steps,
            "in_flight": run.settings.in_flight(optimizer_steps),
            "settings": vars(run.settings).copy(),
        }
        run.barrier()  # every node's file is complete before global rank 0 publishes


def read_node_state(saved: dict[str, Any], checkpoint_path: Any, node: int, num_nodes: int) -> dict[str, Any]:
    """This node's state of a checkpoint whose shared part is ``saved``, checked to belong to it.

    Raises:
        ValueError: one line saying why this checkpoint cannot resume this run exactly.
    """
    if saved.get("written_on_stop"):
        raise ValueError(
            "outer_sync: this checkpoint was written when a stop signal ended the fit, and holds the global weights "
            "only (the nodes do not agree on a step to stop at yet): resume from the last periodic checkpoint, or "
            "load its weights into a new run."
        )
    steps = saved["optimizer_steps"]
    if saved["in_flight"]:
        raise ValueError(
            f"outer_sync: this checkpoint was written after step {steps}, while a fragment's all-reduce was in flight, "
            "and cannot resume exactly; resume from a checkpoint at a multiple of every/fragments steps "
            "(e.g. ModelCheckpoint(every_n_train_steps=...) a multiple of it)."
        )
    if saved["num_nodes"] != num_nodes:
        raise ValueError(
            f"outer_sync: this checkpoint was written by {saved['num_nodes']} nodes and this run has {num_nodes}: "
            "resume on as many nodes, or load only its weights (the global ones) into a new run."
        )
    path = node_file(checkpoint_path, node, follow_link=True)
    state = read_side_file(path, weights_only=False)
    if state.get("optimizer_steps") != steps or state.get("node") != node:
        found = state.get("optimizer_steps")
        raise ValueError(f"outer_sync: {path} belongs to another save (step {found}, not {steps}).")
    return state


def restore_node_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put this node's own weights and inner optimizer state back (its random states: the caller)."""
    with torch.no_grad():
        for parameter, saved in zip(model.parameters(), state["weights"]):
            parameter.copy_(saved)
    optimizer.load_state_dict(state["inner_optimizer"])


def remove_node_files(checkpoint_path: Any) -> None:
    """Remove the nodes' files of ``checkpoint_path``, then the folder if empty; nothing else there is touched."""
    folder = f"{checkpoint_path}{NODES_SUFFIX}"
    fs, root = fsspec.core.url_to_fs(folder)
    if not fs.isdir(root):
        return
    for entry in fs.ls(root, detail=False):
        if _NODE_FILE.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1]):
            fs.rm(entry)
    if not fs.ls(root, detail=False):
        fs.rmdir(root)
