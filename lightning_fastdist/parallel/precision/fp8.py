"""fp8 training of a model's wide linear layers with torchao's float8 (torch and torchao only, no Lightning).

torchao swaps each chosen ``nn.Linear`` for a ``Float8Linear``: its three matmuls (forward, and both of the backward)
run in fp8 with dynamic scales, its weights and the rest of the model stay as they were. fp8 pays only where a
matmul is large enough for the faster tensor cores to outweigh the casts around it, and the hardware needs both
dimensions divisible by 16; :func:`layer_verdicts` applies torchao's own thresholds for each recipe (measured on
H100s) and says, for every linear layer, why it is left out. Under FSDP2 the converted weights can be all-gathered in
fp8 (half of bf16's bytes); their scales are then computed for all of them at once after each optimizer step
(:func:`precompute_fp8_scales`). fp8 needs a GPU of compute capability 8.9 or newer (H100, H200, L4, L40S, ...) and
torch.compile to fuse the casts: eager fp8 is slower than bf16.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence

import torch
from torch import nn

FP8_RECIPES = ("tensorwise", "rowwise")
# Compute capability each recipe needs: fp8 tensor cores for tensorwise scaling; rowwise scaling's kernels are Hopper's.
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}
DEFAULT_SKIP = ("lm_head",)  # the output head: its logits decide the loss, and torchtitan keeps it in bf16 too
INSTALL_HINT = "pip install torchao"
DIVISOR = 16  # fp8 matmuls need both dimensions divisible by this


def fp8_unavailable(device_type: str, recipe: str = "tensorwise") -> str | None:
    """Why fp8 training cannot run on ``device_type`` (``"cuda"`` or ``"cpu"``) here, in one clause; ``None`` if it can.

    The hardware is asked first (no install fixes a GPU), then whether torchao imports beside this torch.
    """
    needed = MIN_CAPABILITY[recipe]
    if device_type != "cuda" or not torch.cuda.is_available():
        return (
            f"fp8 matmuls need a CUDA GPU of compute capability {needed[0]}.{needed[1]} or newer "
            "(H100, H200, L4, L40S, ...); this run has none"
        )
    capability = torch.cuda.get_device_capability()
    if capability < needed:
        return (
            f"{recipe} fp8 needs compute capability {needed[0]}.{needed[1]} or newer; "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}"
        )
    return torchao_missing()


def torchao_missing() -> str | None:
    """Why torchao's float8 training cannot be imported here (``None``: it can)."""
    try:
        importlib.import_module("torchao.float8")
    except ImportError as error:
        return f"torchao's float8 does not import ({error}); {INSTALL_HINT}"
    return None


def _too_narrow(recipe: str, in_features: int, out_features: int) -> str | None:
    """torchao's thresholds below which its ``recipe`` did not pay on an H100 (``torchao/float8``'s tables)."""
    if recipe == "tensorwise":
        if in_features <= 4096 and out_features <= 1024:
            return "too narrow to pay (tensorwise converts in_features > 4096 or out_features > 1024)"
        return None
    if out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048):
        return "too narrow to pay (rowwise converts out_features > 2048 and in_features > 1024, beyond 4096 x 2048)"
    return None


def layer_verdicts(model: nn.Module, recipe: str = "tensorwise", skip: Sequence[str] = DEFAULT_SKIP) -> dict:
    """For each ``nn.Linear`` of ``model`` by name: ``None`` where fp8 would convert it, else why not."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8: recipe must be one of {', '.join(FP8_RECIPES)}; got {recipe!r}.")
    verdicts: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        skipped_by = next((fragment for fragment in skip if fragment in name), None)
        if skipped_by is not None:
            verdicts[name] = f"skipped by name ({skipped_by!r})"
        elif module.in_features % DIVISOR or module.out_features % DIVISOR:
            verdicts[name] = f"{module.in_features} x {module.out_features} is not divisible by {DIVISOR}"
        else:
            verdicts[name] = _too_narrow(recipe, module.in_features, module.out_features)
    return verdicts


def fp8_layers(model: nn.Module, recipe: str = "tensorwise", skip: Sequence[str] = DEFAULT_SKIP) -> list[str]:
    """Names of the linear layers fp8 would convert, in the model's order."""
    return [name for name, reason in layer_verdicts(model, recipe, skip).items() if reason is None]


def no_layer_reason(model: nn.Module, recipe: str, skip: Sequence[str]) -> str:
    """The one line saying why no layer of ``model`` qualifies for fp8."""
    verdicts = layer_verdicts(model, recipe, skip)
    if not verdicts:
        return (
            f"fp8: {type(model).__name__} has no nn.Linear layer (torchao converts nn.Linear only; "
            "HuggingFace's GPT-2 uses its own Conv1D); train in bf16-mixed"
        )
    reasons = sorted({reason for reason in verdicts.values() if reason is not None})
    return (
        f"fp8: none of the {len(verdicts)} linear layers of {type(model).__name__} qualifies for {recipe} fp8: "
        f"{'; '.join(reasons)}; train in bf16-mixed"
    )


def convert_to_fp8(
    model: nn.Module,
    recipe: str = "tensorwise",
    skip: Sequence[str] = DEFAULT_SKIP,
    fsdp_all_gather: bool = False,
    emulate: bool = False,
) -> list[str]:
    """Swap the layers :func:`fp8_layers` picks for torchao's ``Float8Linear``, in place; return their names.

    Args:
        fsdp_all_gather: the weights will be sharded by FSDP2: all-gather them in fp8 (call
            :func:`precompute_fp8_scales` after each optimizer step).
        emulate: compute the fp8 matmuls in high precision (torchao's emulation, any device): to test the
            plumbing without fp8 hardware; nothing is faster.

    Raises:
        ValueError: no layer qualifies (one line: why, for each kind of layer left out).
    """
    chosen = set(fp8_layers(model, recipe, skip))
    if not chosen:
        raise ValueError(no_layer_reason(model, recipe, skip) + ".")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415 - optional package

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate
    )
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return [name for name, _ in model.named_modules() if name in chosen]


def converted_layers(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` that train in fp8 (torchao's ``Float8Linear``)."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def precompute_fp8_scales(model: nn.Module) -> None:
    """After an optimizer step, compute the fp8 scales of every FSDP2-sharded fp8 weight in one all-reduce (otherwise
    each weight's all-gather reduces its own)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415 - optional package

    precompute_float8_dynamic_scale_for_fsdp(model)
