"""``outer_sync`` in checkpoints: what the nodes share in the checkpoint, what each node alone holds beside it.

The checkpoint holds the global weights (so it loads into a plain model as what the nodes agreed on), the outer
optimizers and torchft's step count. Each node's own weights, inner optimizer and random states go beside it, in
``<checkpoint>.outer_sync/stepSSSSSSSSS/nodeNNNNN.pt`` (DDP) or a distributed checkpoint folder ``nodeNNNNN`` of
shards (FSDP), written before global rank 0 publishes; the nodes count each other's saves in node 0's store, since a
node that rejoined at that step has nothing to write and a collective would pair with its next one. The step's folder
is the save's own (:mod:`~lightning_fastdist.parallel.checkpoint.side_saves`): the checkpoint and its node files are
published together by the checkpoint's one rename, and the previous pair stays until then. Node files are read
weights-only: nothing from a side file is unpickled.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_fastdist.parallel.across_nodes.group import LEFT_OUT_AFTER, ReplicaGroup
from lightning_fastdist.parallel.across_nodes.outer_sync.run import OuterSyncRun
from lightning_fastdist.parallel.checkpoint.atomic import is_local_path
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError
from lightning_fastdist.parallel.checkpoint.save_failure import agree_on_save
from lightning_fastdist.parallel.checkpoint.sharded_folder import save_sharded_folder
from lightning_fastdist.parallel.checkpoint.side_saves import OUTER_SYNC_NODES
from lightning_fastdist.strategies.checkpoint.side_files import read_side_file, write_side_file

CHECKPOINT_KEY = "fast_outer_sync"
_SHARDED_NODE_META = "node.pt"  # in a node's folder: what is not a shard (its step, its ranks' random states)


def node_file(checkpoint_path: Any, node: int, step: int, sharded: bool = False, follow_link: bool = False) -> str:
    """Where node ``node``'s state of the save at global step ``step`` of the checkpoint at ``checkpoint_path``
    lives (beside the file a link names): a file, or a folder of shards (``sharded``)."""
    path = str(checkpoint_path)
    if follow_link and is_local_path(path):
        path = str(Path(path).resolve())
    return f"{OUTER_SYNC_NODES.save_folder(path, step)}/node{node:05d}{'' if sharded else '.pt'}"


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
    """Write this node's own state beside ``filepath`` and the shared part into ``checkpoint``; call on every rank of
    every node, before rank 0 publishes ``checkpoint``.

    Args:
        run: ``None`` where this process does not talk across nodes.
        node_rank_states: the random states of this node's ranks (gathered on its local rank 0), else ``None``.
    """
    path = node_file(filepath, group.node_rank, optimizer_steps, group.sharded)
    if run is None:  # under DDP the node's local rank 0 writes: the others learn how that went
        agree_on_save(None, Path(path))
        return
    own = {"node": group.node_rank, "optimizer_steps": optimizer_steps, "rng": node_rank_states}
    shared = {
        **run.state_dict(),
        "num_nodes": group.num_nodes,
        "optimizer_steps": optimizer_steps,
        "in_flight": run.settings.in_flight(optimizer_steps),
        "settings": vars(run.settings).copy(),
    }
    if group.sharded:  # each rank's shards of the weights and of both optimizers' states
        shared.pop("outer_optimizers")
        shared["ranks_per_node"] = group.ranks_per_node
        save_sharded_folder(_sharded_state(run, model, optimizer), {_SHARDED_NODE_META: own}, Path(path))
    else:
        weights = [p.detach().to("cpu", copy=True) for p in model.parameters()]
        failure = None
        try:
            write_side_file({**own, "weights": weights, "inner_optimizer": optimizer.state_dict()}, path)
        except Exception as error:  # noqa: BLE001 - the node's every rank raises it, through agree_on_save
            failure = error
        agree_on_save(failure, Path(path))
    checkpoint[CHECKPOINT_KEY] = shared
    missing = run.wait_for_saves(optimizer_steps)  # every node's state is complete before global rank 0 publishes
    if missing and group.node_rank == 0 and group.local_rank == 0:
        warnings.warn(
            f"outer_sync: {', '.join(missing)} did not write its state of the checkpoint of step {optimizer_steps} "
            f"within {LEFT_OUT_AFTER.seconds} s (it left the job since the last sync): a resume gives a node without "
            "its state another node's.",
            stacklevel=2,
        )


def _sharded_state(run: OuterSyncRun, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of a node's own state, by name, as ``torch.distributed.checkpoint`` saves and loads them."""
    return {
        "model": get_model_state_dict(model),
        "inner_optimizer": get_optimizer_state_dict(model, optimizer),
        "outer_optimizers": [
            get_optimizer_state_dict(fragment, outer) for fragment, outer in zip(run.fragments, run.outer_optimizers)
        ],
    }


def read_node_state(
    saved: dict[str, Any], checkpoint_path: Any, node: int, num_nodes: int, ranks_per_node: int
) -> dict[str, Any]:
    """This node's state of a checkpoint whose shared part is ``saved``, checked to belong to it (of a sharded node
    what is not a shard: :func:`restore_node_state` reads those).

    Raises:
        UnusableCheckpointError: one line saying why this checkpoint cannot resume this run exactly (also a
            ``ValueError``).
    """
    refusal = resume_refusal(saved, num_nodes, ranks_per_node)
    if refusal is not None:
        raise UnusableCheckpointError(refusal)
    steps = saved["optimizer_steps"]
    sharded = "ranks_per_node" in saved
    source = _node_with_state(checkpoint_path, node, num_nodes, steps, sharded)
    path = node_file(checkpoint_path, source, steps, sharded, follow_link=True)
    try:
        state = read_side_file(f"{path}/{_SHARDED_NODE_META}" if sharded else path)
    except pickle.UnpicklingError:
        raise UnusableCheckpointError(
            f"outer_sync: {path} holds more than tensors and plain values, and a node's file is never unpickled: "
            "it was not written by this package; resume from another checkpoint."
        ) from None
    state["path"] = path
    if state.get("optimizer_steps") != steps or state.get("node") != source:
        found = state.get("optimizer_steps")
        raise UnusableCheckpointError(f"outer_sync: {path} belongs to another save (step {found}, not {steps}).")
    if source != node:
        warnings.warn(
            f"outer_sync: node{node} has no state in this checkpoint (it had left the job when step {steps} was "
            f"saved): it resumes from node{source}'s weights and optimizer state, as a node that rejoins a running "
            "job does, and with random states of its own.",
            stacklevel=2,
        )
        state["rng"] = None  # another node's random states would repeat its draws
    return state


def resume_refusal(saved: dict[str, Any], num_nodes: int, ranks_per_node: int) -> str | None:
    """Why the checkpoint whose shared part is ``saved`` cannot resume a run of ``num_nodes`` nodes of
    ``ranks_per_node`` ranks exactly, in one line; ``None`` where it can."""
    if saved.get("written_on_stop"):
        return (
            "outer_sync: this checkpoint was written when a stop signal ended the fit, and holds the global weights "
            "only (the nodes do not agree on a step to stop at yet): resume from the last periodic checkpoint, or "
            "load its weights into a new run."
        )
    steps = saved["optimizer_steps"]
    if saved["in_flight"]:  # the all-reduce's result is not in the checkpoint
        return (
            f"outer_sync: this checkpoint was written after step {steps}, while a fragment's all-reduce was in flight, "
            "and cannot resume exactly; resume from a checkpoint at a multiple of every/fragments steps "
            "(e.g. ModelCheckpoint(every_n_train_steps=...) a multiple of it)."
        )
    if saved["num_nodes"] != num_nodes or saved.get("ranks_per_node", ranks_per_node) != ranks_per_node:
        return (
            f"outer_sync: this checkpoint was written by {saved['num_nodes']} nodes of "
            f"{saved.get('ranks_per_node', ranks_per_node)} ranks and this run has {num_nodes} of {ranks_per_node}: "
            "resume on as many nodes and ranks, or load only its weights (the global ones) into a new run."
        )
    return None


def _node_with_state(checkpoint_path: Any, node: int, num_nodes: int, step: int, sharded: bool) -> int:
    """``node`` if the checkpoint holds its state, else the first node whose state it holds: a node that had left the
    job (``min_nodes``) when the others saved wrote none."""
    for candidate in (node, *range(num_nodes)):
        fs, path = fsspec.core.url_to_fs(node_file(checkpoint_path, candidate, step, sharded, follow_link=True))
        if fs.exists(path):
            return candidate
    raise UnusableCheckpointError(
        f"outer_sync: {node_file(checkpoint_path, node, step, sharded)} is missing, and so is every other node's "
        "state beside this checkpoint: resume from another checkpoint, or load only its weights (the global ones)."
    )


def restore_node_state(
    state: dict[str, Any], run: OuterSyncRun | None, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Put this node's own weights and inner optimizer state back (under FSDP this rank's shards, and of the outer
    optimizers too); its random states: the caller."""
    if "weights" not in state:  # a folder of shards
        assert run is not None, "every rank of a node holding shards talks across nodes"
        shards = _sharded_state(run, model, optimizer)
        dcp.load(shards, checkpoint_id=state["path"])
        set_model_state_dict(model, shards["model"])
        set_optimizer_state_dict(model, optimizer, shards["inner_optimizer"])
        for fragment, outer, saved in zip(run.fragments, run.outer_optimizers, shards["outer_optimizers"]):
            set_optimizer_state_dict(fragment, outer, saved)
        return
    with torch.no_grad():
        for parameter, saved in zip(model.parameters(), state["weights"]):
            parameter.copy_(saved)
    optimizer.load_state_dict(state["inner_optimizer"])


def remove_node_files(checkpoint_path: Any) -> None:
    """Remove the nodes' files and folders of every save of ``checkpoint_path``, then the folders holding them if
    empty; nothing else there is touched."""
    OUTER_SYNC_NODES.remove(checkpoint_path)
