"""A FastFSDPStrategy sharded checkpoint folder as one Lightning checkpoint, in the form Lightning's ``DDPStrategy``
writes (full weights; each optimizer's state numbered by parameter, as ``torch.optim.Optimizer.state_dict`` has it).

The folder is Lightning's sharded layout: the weights and each optimizer's state as shards of every rank
(``torch.distributed.checkpoint``, the optimizer's state keyed by parameter name), the rest in Lightning's metadata
file. One process reads every shard; no process group.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def one_file_of_sharded_folder(folder: Path) -> dict[str, Any]:
    """The checkpoint in ``folder`` as one dict: Lightning's metadata, ``state_dict`` and ``optimizer_states``.

    Read with ``weights_only=False``, as Lightning reads a checkpoint by default: read only checkpoints you trust.
    """
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder, Path(scratch) / "shards.pt")
        shards = torch.load(Path(scratch) / "shards.pt", map_location="cpu", weights_only=False)
    checkpoint = torch.load(folder / _METADATA_FILENAME, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = shards["state_dict"]
    count = len([key for key in shards if key.startswith("optimizer_")])
    checkpoint["optimizer_states"] = [numbered_by_parameter(shards[f"optimizer_{index}"]) for index in range(count)]
    return checkpoint


def numbered_by_parameter(by_name: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state keyed by parameter name (``torch.distributed.checkpoint``'s form) keyed by number instead,
    the parameters numbered in the order of its groups (``torch.optim.Optimizer.state_dict``'s form)."""
    names = [name for group in by_name["param_groups"] for name in group["params"]]
    numbers = {name: number for number, name in enumerate(names)}
    return {
        "state": {numbers[name]: state for name, state in by_name["state"].items()},
        "param_groups": [
            {**group, "params": [numbers[name] for name in group["params"]]} for group in by_name["param_groups"]
        ],
    }
