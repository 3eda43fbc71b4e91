"""Everyday Lightning patterns an engine of ours cannot run as ``DDPStrategy`` does, found in the user's code and
callbacks when a fit sets up, before the first step, and refused in one line that says what to use instead
(``docs/migration.md`` lists each). Each strategy names the patterns it refuses; the others it runs as DDP does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, LearningRateFinder, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities import grad_norm as lightnings_grad_norm
from lightning.pytorch.utilities.model_helpers import is_overridden

# The hooks in which a user reads gradients, where Lightning's grad_norm is called.
_GRADIENT_HOOKS = ("on_before_optimizer_step", "on_after_backward", "optimizer_step", "on_train_batch_end")


class Unsupported(NamedTuple):
    """A pattern: where the fit's code uses it (``None``: it does not), and the rest of the refusal's line."""

    found: Callable[[pl.Trainer], str | None]
    why_and_instead: str


def _hooks(trainer: pl.Trainer) -> Iterator[tuple[str, Any]]:
    """``(where, function)`` for each gradient hook the LightningModule and the callbacks define."""
    owners: list[Any] = [trainer.lightning_module, *trainer.callbacks]
    for owner in owners:
        for hook in _GRADIENT_HOOKS:
            function = getattr(type(owner), hook, None)
            if getattr(function, "__code__", None) is not None:
                yield f"{type(owner).__name__}.{hook}", function


def _calls_lightnings_grad_norm(trainer: pl.Trainer) -> str | None:
    for where, function in _hooks(trainer):
        if lightnings_grad_norm in _names_used(function):
            return f"{where} calls Lightning's grad_norm"
    return None


def _names_used(function: Any) -> list[Any]:
    """What the names a function's code reads are bound to: its globals (and what a module among them holds under a
    name the code reads, as in ``utilities.grad_norm``), and the variables it closes over."""
    code = function.__code__
    values = [function.__globals__.get(name) for name in code.co_names]
    values += [getattr(value, name, None) for value in values if inspect.ismodule(value) for name in code.co_names]
    for cell in function.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a variable not yet assigned
            continue
    return values


def _overrides_gradient_clipping(trainer: pl.Trainer) -> str | None:
    module = trainer.lightning_module
    if is_overridden("configure_gradient_clipping", module):
        return f"{type(module).__name__} overrides configure_gradient_clipping"
    return None


def _callback(kind: type[Callback], what: str) -> Callable[[pl.Trainer], str | None]:
    def found(trainer: pl.Trainer) -> str | None:
        callback = next((callback for callback in trainer.callbacks if isinstance(callback, kind)), None)
        return f"{type(callback).__name__} {what}" if callback is not None else None

    return found


_GRAD_NORM_INSTEAD = "call lightning_fastdist.grad_norm instead (the same arguments, names and values as under DDP)"
GRAD_NORM_SHARDED = Unsupported(
    _calls_lightnings_grad_norm,
    f"which reads each p.grad whole, where FSDP2 keeps the gradients sharded (DTensors): {_GRAD_NORM_INSTEAD}",
)
GRAD_NORM_IN_ENGINE = Unsupported(
    _calls_lightnings_grad_norm,
    f"which reads each p.grad, where ZeRO keeps the gradients in DeepSpeed's engine (None): {_GRAD_NORM_INSTEAD}",
)
GRADIENT_CLIPPING_OVERRIDE = Unsupported(
    _overrides_gradient_clipping,
    "and DeepSpeed's engine clips inside its own step, where self.clip_gradients does nothing: clip by norm with "
    "Trainer(gradient_clip_val=...), or use FastDDPStrategy or FastFSDPStrategy, which run the override",
)
WEIGHT_AVERAGING = Unsupported(
    _callback(WeightAveraging, "keeps an unsharded copy of the model"),
    "and copies the sharded weights into it, which FSDP2's DTensors refuse: use FastDDPStrategy or "
    "FastDeepSpeedStrategy (stage 1 or 2) for weight averaging",
)
STOCHASTIC_WEIGHT_AVERAGING = Unsupported(
    _callback(StochasticWeightAveraging, "keeps an unsharded copy of the model"),
    "and copies the sharded weights into it, which FSDP2's DTensors refuse (Lightning refuses it under its own "
    "sharded strategies, DeepSpeed's included): use FastDDPStrategy for stochastic weight averaging",
)
LR_FIND = Unsupported(
    _callback(LearningRateFinder, "(Tuner.lr_find) steps the LightningModule's own torch optimizer"),
    "which DeepSpeed's engine replaces: find the learning rate with FastDDPStrategy on the same model, then give it "
    "here",
)


# What each engine refuses; the other patterns it runs as DDP does.
FSDP_REFUSALS = (GRAD_NORM_SHARDED, WEIGHT_AVERAGING, STOCHASTIC_WEIGHT_AVERAGING)
DEEPSPEED_REFUSALS = (GRAD_NORM_IN_ENGINE, GRADIENT_CLIPPING_OVERRIDE, LR_FIND)


def refuse_unsupported(trainer: pl.Trainer, owner: str, patterns: tuple[Unsupported, ...]) -> None:
    """Raise the one-line ``ValueError`` of the first of ``patterns`` the fit uses; call first in ``setup``."""
    for pattern in patterns:
        where = pattern.found(trainer)
        if where is not None:
            raise ValueError(f"{owner}: {where}, {pattern.why_and_instead}.")
