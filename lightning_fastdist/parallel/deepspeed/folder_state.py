"""A DeepSpeed ZeRO checkpoint folder's training state as one process holds it without DeepSpeed: each parameter's full
fp32 weight, and its optimizer's state per parameter, in the form ``torch.optim.Optimizer.state_dict`` has.

ZeRO keeps each rank's part of flat buffers. At stages 1 and 2 each parameter group is one flat fp32 buffer, its
parameters laid end to end (each followed by its alignment padding), cut into one equal part per rank; at stage 3 each
parameter is cut into equal parts (the last padded), and each rank lays its parts end to end. The torch optimizer
DeepSpeed steps sees a rank's part as its one parameter, so the optimizer's state (SGD's momentum, Adam's moments) has
that layout too, and its scalars (Adam's ``step``) are one per group. DeepSpeed's own ``zero_to_fp32`` reassembles the
weights; a resume needs the optimizer's state as well, reassembled here the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# What DeepSpeed writes into a model states file besides its caller's state.
DEEPSPEED_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
        "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
        "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
        "checkpoint_parallel_dimensions",
    }
)  # fmt: skip

# Where an optimizer states file keeps its rank's part of the fp32 weights and the torch optimizer's state (at stage 3:
# True).
LAYOUT_KEYS = {
    False: ("single_partition_of_fp32_groups", "base_optimizer_state"),
    True: ("fp32_flat_groups", "optimizer_state_dict"),
}
GroupReassembly = Callable[[int, list[torch.Tensor]], dict[str, torch.Tensor]]


def folder_training_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The weights by name (trainable ones from the fp32 masters, the frozen ones and the buffers as saved), the torch
    optimizer's state dict, and the rest of rank 0's model states file (its caller's: Lightning's loops and so on).

    Read with ``weights_only=False``, as DeepSpeed and Lightning read these files (they hold DeepSpeed's objects): read
    only checkpoints you trust.
    """
    tag_folder = folder / (folder / "latest").read_text().strip()
    model_states = [_load(path) for path in _rank_files(tag_folder, "model_states")]
    per_rank = [_load(path)["optimizer_state_dict"] for path in _rank_files(tag_folder, "optim_states")]
    shapes: list[dict[str, torch.Size]] = model_states[0]["param_shapes"]
    stage_3 = per_rank[0]["zero_stage"] == 3
    group = _stage_3_group(shapes) if stage_3 else _stage_1_or_2_group(shapes, per_rank[0])
    flat_key, base_key = LAYOUT_KEYS[stage_3]
    weights = {name: value for name, value in model_states[0]["module"].items() if value.numel() > 0}
    weights.update(_frozen_fragments_joined(model_states))
    for number in range(len(shapes)):
        weights.update(group(number, [ranks[flat_key][number] for ranks in per_rank]))
    for alias, name in model_states[0].get("shared_params", {}).items():
        weights[alias] = weights[name]
    optimizer = _optimizer_state(shapes, [ranks[base_key] for ranks in per_rank], group)
    return weights, optimizer, {key: value for key, value in model_states[0].items() if key not in DEEPSPEED_KEYS}


def _optimizer_state(
    shapes: list[dict[str, torch.Size]], per_rank: list[dict[str, Any]], group: GroupReassembly
) -> dict[str, Any]:
    """The torch optimizer's state dict: parameters numbered in group order, each state of a group reassembled per
    parameter as its weights are (a scalar given to each of the group's parameters)."""
    numbers = {name: index for index, name in enumerate(name for names in shapes for name in names)}
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    for number, (names, saved) in enumerate(zip(shapes, per_rank[0]["param_groups"], strict=True)):
        hyperparameters = {key: value for key, value in saved.items() if key != "params"}
        param_groups.append({**hyperparameters, "params": [numbers[name] for name in names]})
        for key, value in per_rank[0]["state"].get(number, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                parts = group(number, [ranks["state"][number][key] for ranks in per_rank])
            else:
                parts = dict.fromkeys(names, value)
            for name, part in parts.items():
                state.setdefault(numbers[name], {})[key] = part
    return {"state": state, "param_groups": param_groups}


def _stage_1_or_2_group(shapes: list[dict[str, torch.Size]], rank_zero: dict[str, Any]) -> GroupReassembly:
    """A group's flat buffer: the ranks' parts end to end, cut into its parameters (alignment paddings skipped)."""
    paddings = rank_zero.get("param_alignment_paddings")

    def reassemble(number: int, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        flat, offset, full = torch.cat(parts), 0, {}
        for index, (name, shape) in enumerate(shapes[number].items()):
            full[name] = flat.narrow(0, offset, math.prod(shape)).view(shape).clone()
            offset += math.prod(shape) + (paddings[number][index] if paddings else 0)
        return full

    return reassemble


def _stage_3_group(shapes: list[dict[str, torch.Size]]) -> GroupReassembly:
    """Each parameter of a group: its equal part on every rank, joined, the padding cut off."""

    def reassemble(number: int, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        offset, full = 0, {}
        for name, shape in shapes[number].items():
            part = math.ceil(math.prod(shape) / len(parts))
            joined = torch.cat([rank_part.narrow(0, offset, part) for rank_part in parts])
            full[name] = joined[: math.prod(shape)].view(shape).clone()
            offset += part
        return full

    return reassemble


def _frozen_fragments_joined(model_states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stage 3's frozen parameters: each rank's fragment of each, joined (none below stage 3)."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    fragments = [ranks.get("frozen_param_fragments") or {} for ranks in model_states]
    return {
        name: torch.cat([rank[name] for rank in fragments])[: math.prod(shape)].view(shape)
        for name, shape in shapes.items()
        if all(name in rank for rank in fragments)
    }


def _rank_files(tag_folder: Path, kind: str) -> list[Path]:
    """The folder's ``*_{kind}.pt`` files in rank order (``mp_rank_00_model_states.pt`` alone below stage 3)."""
    files = list(tag_folder.glob(f"*_{kind}.pt"))
    return sorted(
        files, key=lambda path: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]
    )


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
