"""NonFiniteLoss: skip or stop on a NaN/inf training loss without reading the loss on the host every step.

Lightning's ``detect_anomaly`` and the usual ``if not torch.isfinite(loss)`` wait for the device every step; here
the loss goes into a device flag, all-reduced (max) before the optimizer step so every rank decides alike, and the
host reads the count of bad steps once per check interval (and before a checkpoint).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fastdist.parallel.precision.fused_optimizer import fuse_optimizer

log = logging.getLogger(__name__)

ACTIONS = ("skip", "stop", "off")
METRIC = "nonfinite_loss/steps"


class NonFiniteLossError(RuntimeError):
    """Raised on every rank by ``NonFiniteLoss(action="stop")``."""


class NonFiniteLoss(Callback):
    """Skip the optimizer step, or stop training, when the training loss is NaN or inf.

    Args:
        action: ``"skip"`` (the fused optimizer leaves weights and state untouched, as with ``GradScaler``'s
            ``found_inf``), ``"stop"`` (raise :class:`NonFiniteLossError` on every rank at the next check) or ``"off"``.
        check_every_n_steps: optimizer steps between two host reads of the count of bad steps; ``None`` uses the
            trainer's ``log_every_n_steps``, so the read lands where the loggers read their values anyway.
        max_consecutive_skips: with ``"skip"``, stop at the next check once this many steps in a row had a bad loss.
    """

    def __init__(
        self,
        action: Literal["skip", "stop", "off"] = "skip",
        check_every_n_steps: int | None = None,
        max_consecutive_skips: int = 5,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"NonFiniteLoss: action must be one of {', '.join(map(repr, ACTIONS))}, got {action!r}.")
        if check_every_n_steps is not None and not _is_positive_int(check_every_n_steps):
            raise ValueError(
                f"NonFiniteLoss: check_every_n_steps must be an integer >= 1 or None, got {check_every_n_steps!r}."
            )
        if not _is_positive_int(max_consecutive_skips):
            raise ValueError(
                f"NonFiniteLoss: max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}."
            )
        self.action = action
        self.check_every_n_steps = check_every_n_steps
        self.max_consecutive_skips = max_consecutive_skips
        self._bad_now: Tensor | None = None  # 1.0 if a loss since the last optimizer step was not finite
        self._bad_steps: Tensor | None = None  # optimizer steps with a non-finite loss in this fit, on the device
        self._bad_run: Tensor | None = None  # bad steps in a row up to the last one, on the device
        self._longest_bad_run: Tensor | None = None  # the longest such run since the last check, on the device
        self._restored = 0  # bad steps counted before the checkpoint this fit resumed from
        self._reported = 0  # bad steps already reported (host side)
        self._last_check_step = 0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.action != "skip":
            return
        for optimizer in trainer.optimizers:
            reason = fuse_optimizer(optimizer)
            if reason is not None:
                raise ValueError(
                    f"NonFiniteLoss: action='skip' skips steps on the device through a fused optimizer, but {reason}. "
                    "Use Adam, AdamW or SGD, or action='stop'."
                )

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self.action == "off":
            return
        bad = torch.logical_not(torch.isfinite(loss.detach())).float()
        self._bad_now = bad if self._bad_now is None else torch.maximum(self._bad_now, bad)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        if self._bad_now is None:
            return
        bad, self._bad_now = self._bad_now, None
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # One scalar; every rank decides alike (a strategy whose nodes are worlds of their own takes it across).
            all_reduce_max = getattr(trainer.strategy, "all_reduce_max", None)
            if all_reduce_max is not None:
                bad = all_reduce_max(bad)
            else:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if self.action == "skip":
            optimizer.found_inf = bad  # read by the fused kernel, which then leaves everything unchanged
        self._bad_steps = bad.clone() if self._bad_steps is None else self._bad_steps + bad
        self._bad_run = bad.clone() if self._bad_run is None else (self._bad_run + 1) * bad
        self._longest_bad_run = (
            self._bad_run if self._longest_bad_run is None else torch.maximum(self._longest_bad_run, self._bad_run)
        )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._bad_steps is None:
            return
        pl_module.log(METRIC, self._bad_steps + self._restored, on_step=True, on_epoch=False)
        every = self.check_every_n_steps or trainer.log_every_n_steps or 1
        if trainer.global_step % every == 0 and trainer.global_step != self._last_check_step:
            self._check(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._bad_steps is not None:
            self._check(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for optimizer in trainer.optimizers:
            optimizer.__dict__.pop("found_inf", None)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A save waits for the device anyway: check now, so that "stop" never saves the weights a bad step spoiled.
        if self.action == "stop" and self._bad_steps is not None:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        """The one host read: report new bad steps (``skip``) or stop (``stop``, or ``skip`` with too long a run)."""
        assert self._bad_steps is not None and self._longest_bad_run is not None
        bad_steps, longest_run = (int(n) for n in torch.stack([self._bad_steps, self._longest_bad_run]).tolist())
        self._longest_bad_run = self._bad_run  # the next window starts with the run still going on
        total = self._restored + bad_steps
        new, first = total - self._reported, self._last_check_step
        self._reported, self._last_check_step = total, trainer.global_step
        if new == 0:
            return
        where = f"{new} optimizer step(s) between steps {first} and {trainer.global_step} had a NaN/inf training loss"
        if self.action == "stop":
            raise NonFiniteLossError(f"NonFiniteLoss(action='stop'): {where}; stopping (rank {trainer.global_rank}).")
        if longest_run >= self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"NonFiniteLoss(action='skip'): {where}, {longest_run} of them in a row "
                f"(max_consecutive_skips={self.max_consecutive_skips}); stopping: the run is diverging, lower the "
                f"learning rate or resume from an earlier checkpoint (rank {trainer.global_rank})."
            )
        if trainer.is_global_zero:
            log.warning(f"NonFiniteLoss: {where}; skipped them ({total} skipped so far).")

    @override
    def state_dict(self) -> dict[str, Any]:
        # Read when a checkpoint is written (which waits for the device anyway), not per step.
        return {"bad_steps": self._restored + (0 if self._bad_steps is None else int(self._bad_steps.item()))}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = self._reported = int(state_dict["bad_steps"])


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
