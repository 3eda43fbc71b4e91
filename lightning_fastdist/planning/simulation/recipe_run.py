"""What a simulation takes from a recipe, and how it builds the recipe's model and reads a batch of its data.

A model or data module that cannot be built is :class:`NotTraceable`: the simulation says why in one line and
``doctor`` falls back to the formula.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_fastdist.recipes.recipe import Recipe, RecipeError, build


class NotTraceable(Exception):
    """The model or its step cannot be traced with fake tensors; the message says why, in one line."""


@dataclass(frozen=True)
class RecipeRun:
    """What the simulation takes from a recipe: its ``model:`` and ``data:`` sections, its precision (``trainer``'s or
    a precision plugin's), ``accumulate_grad_batches`` and its strategy's ``blocks``, ``outer_sync`` and
    ``replica_groups`` options."""

    model: dict
    data: dict
    precision: str = "32-true"
    accumulation: int = 1
    blocks: str | list[str] = "auto"
    outer_sync: dict | None = None
    replica_groups: dict | None = None

    @classmethod
    def of(cls, recipe: Recipe, micro_batch: int | None = None) -> RecipeRun:
        """What ``recipe`` trains, at ``micro_batch`` samples per batch (``None``: the recipe's)."""
        data = recipe.section("data")
        if micro_batch is not None:
            data["init_args"]["batch_size"] = micro_batch
        options = recipe.strategy_options
        return cls(
            recipe.section("model"), data, recipe.precision, recipe.accumulation, recipe.blocks,
            options.get("outer_sync"), options.get("replica_groups"),
        )  # fmt: skip


def _instantiate(kind: str, section: dict) -> Any:
    try:
        return build(kind, section)
    except RecipeError as error:
        raise NotTraceable(str(error)) from None


def first_batch(data_section: dict) -> Any:
    """One training batch of the recipe's data module, as its ``train_dataloader`` gives it (real tensors, small)."""
    data = _instantiate("data", data_section)
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def build_model(run: RecipeRun, fake: bool) -> LightningModule:
    """The recipe's model: on the meta device with ``fake`` (no memory, no weights), else for real."""
    with torch.device("meta") if fake else nullcontext():
        return _instantiate("model", run.model)
