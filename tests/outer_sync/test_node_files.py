"""Each node's own state under ``outer_sync``, beside the checkpoint it belongs to (issue 56, items 4 and 10), on real
files in one process: the mechanism the nodes' processes call (``tests/outer_sync/test_outer_sync.py`` runs them).

A node's file used to be replaced in place before global rank 0 published the checkpoint naming it: a kill or a full
disk in between left a pair that would not resume, the previous consistent pair already overwritten. And node files
were read with ``weights_only=False``: a file planted there ran its code in every node that resumed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fastdist.parallel.checkpoint.atomic import save_file_atomically
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError
from lightning_fastdist.parallel.checkpoint.side_saves import OUTER_SYNC_NODES
from lightning_fastdist.strategies.across_nodes.outer_sync_checkpoint import CHECKPOINT_KEY, node_file, read_node_state
from lightning_fastdist.strategies.checkpoint.side_files import write_side_file

NODES = 2


def write_node_file(checkpoint: Path, node: int, step: int, **extra: object) -> None:
    """What node ``node`` writes beside ``checkpoint`` for the save of ``step`` (its weights: the step)."""
    state = {"node": node, "optimizer_steps": step, "rng": None, "weights": [torch.full((2,), float(step))]}
    write_side_file({**state, "inner_optimizer": {}, **extra}, node_file(checkpoint, node, step))


def publish_checkpoint(checkpoint: Path, step: int) -> None:
    """Global rank 0 publishes the checkpoint of ``step`` once every node wrote its file."""
    shared = {"optimizer_steps": step, "in_flight": False, "num_nodes": NODES}
    save_file_atomically(lambda staged: torch.save({CHECKPOINT_KEY: shared}, staged), checkpoint, step=step)


def resumed_steps(checkpoint: Path) -> list[int]:
    """The step of the state each node resumes from."""
    saved = torch.load(checkpoint, weights_only=True)[CHECKPOINT_KEY]
    states = [read_node_state(saved, checkpoint, node, NODES, ranks_per_node=1) for node in range(NODES)]
    assert [int(state["weights"][0][0]) for state in states] == [state["optimizer_steps"] for state in states]
    return [state["optimizer_steps"] for state in states]


def test_a_save_killed_after_one_nodes_file_leaves_the_previous_pair_whole_and_resumable(tmp_path):
    last = tmp_path / "last.ckpt"
    for node in range(NODES):
        write_node_file(last, node, step=4)
    publish_checkpoint(last, step=4)
    write_node_file(last, 0, step=8)  # the save of step 8: node 0 wrote, then the job was killed
    assert resumed_steps(last) == [4, 4]
    for node in range(NODES):  # the next save completes: its checkpoint names its files, the older saves' go
        write_node_file(last, node, step=12)
    publish_checkpoint(last, step=12)
    assert resumed_steps(last) == [12, 12]
    assert [p.name for p in Path(OUTER_SYNC_NODES.root(last)).iterdir()] == ["step000000012"]


class Planted:
    """An object whose unpickling runs code: what a node file must never be able to do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return Path.write_text, (self.marker, "ran")


def test_a_node_file_holding_more_than_tensors_is_refused_in_one_line_and_never_unpickled(tmp_path):
    last = tmp_path / "last.ckpt"
    marker = tmp_path / "ran"
    write_node_file(last, 0, step=4, planted=Planted(marker))
    write_node_file(last, 1, step=4)
    publish_checkpoint(last, step=4)
    saved = torch.load(last, weights_only=True)[CHECKPOINT_KEY]
    with pytest.raises(UnusableCheckpointError) as refused:
        read_node_state(saved, last, 0, NODES, ranks_per_node=1)
    assert not marker.exists()  # its code never ran
    path = node_file(last, 0, 4)
    assert str(refused.value).startswith(f"outer_sync: {path} holds more than tensors and plain values")
    assert "\n" not in str(refused.value)
