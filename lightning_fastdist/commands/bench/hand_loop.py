"""The ``hand-loop`` row of bench: the recipe's model, data, optimizer and precision in a plain PyTorch loop.

    python -m lightning_fastdist.commands.bench.hand_loop --output ROW.json [--warmup-steps N] [--compile JSON] \\
        -- --config RECIPE --config OVERLAY --trainer.max_steps N [more fit arguments]

The arguments after ``--`` are read as ``lightning-fastdist fit`` reads them (LightningCLI, not run), so the seed,
the model and the data are the fit rows' own. Then no Trainer runs: the model moves to the device, its AdamW is
switched to the fused kernel (what nanoGPT's loop asks for), its forward (which returns the loss given targets) is
compiled whole, and each optimizer step runs its micro-batches, clips and steps the scheduler as Lightning would.
It is the ceiling a user could write by hand for one GPU, and the check that the Trainer path costs nothing. It
measures what ``BenchProbe`` measures, over the same window, and writes the same JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_fastdist.commands.bench.measures import (
    model_flops_utilization,
    peak_flops_per_device,
    peak_memory_bytes,
    synchronize,
)
from lightning_fastdist.commands.bench.probe import HELD_OUT_BATCHES, SYNC_COUNT_STEPS, TAIL_FRACTION
from lightning_fastdist.commands.bench.step_profile import PROFILE_STEPS, StepProfile
from lightning_fastdist.diagnostics.host_syncs import count_host_syncs
from lightning_fastdist.parallel.precision.fused_optimizer import fuse_optimizer
from lightning_fastdist.recipes.recipe import set_demo_defaults

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs


class _RecipeReader(LightningCLI):
    """LightningCLI that only parses and builds (``run=False``), with the demo workload as the default model and data,
    as ``lightning-fastdist fit`` has them."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        set_demo_defaults(parser)


def read_run(fit_arguments: list[str]) -> tuple[LightningModule, LightningDataModule, Any]:
    """The model, data module and Trainer (only its settings are read) that ``fit`` builds from these arguments."""
    reader = _RecipeReader(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=fit_arguments,
        save_config_callback=None,
    )
    return reader.model, reader.datamodule, reader.trainer


def _batches(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, each epoch's order set as Lightning sets it (``set_epoch``)."""
    epoch = 0
    while True:
        set_epoch = getattr(loader.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def _optimizer_and_scheduler(configured: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The one optimizer and its per-step scheduler (or ``None``) of ``configure_optimizers``' usual forms."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured, None
    if isinstance(configured, dict):
        scheduler = configured.get("lr_scheduler")
        if isinstance(scheduler, dict):
            if scheduler.get("interval", "epoch") != "step":
                raise ValueError("hand-loop: only a scheduler stepped every optimizer step (interval: step) is run")
            scheduler = scheduler["scheduler"]
        return configured["optimizer"], scheduler
    raise ValueError(f"hand-loop: configure_optimizers returned {type(configured).__name__}; one optimizer is run")


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _to(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.to(device, non_blocking=True) for tensor in batch)


class _Schedule:
    """``BenchProbe``'s measuring schedule for a loop that calls :meth:`step_starts` at each optimizer step's start:
    the timed window after the warm-up, then the host syncs of ``SYNC_COUNT_STEPS`` steps, then (``profile``: the
    files' stem) a profile of ``PROFILE_STEPS`` steps, then the last step."""

    def __init__(self, device: torch.device, max_steps: int, warmup_steps: int, profile: Path | None) -> None:
        self.device, self.warmup_steps = device, warmup_steps
        profile_steps = PROFILE_STEPS if profile is not None else 0
        self.timing_ends_at = max(max_steps - SYNC_COUNT_STEPS - profile_steps - 1, warmup_steps + 1)
        self.profile_ends_at = self.timing_ends_at + SYNC_COUNT_STEPS + profile_steps
        self.recorder = StepProfile(profile, device) if profile is not None else None
        self.step_time: float | None = None
        self.sync_count: int | None = None
        self._started: float | None = None
        self._syncs = None

    def step_starts(self, step: int) -> None:
        if self._syncs is not None and step == self.timing_ends_at + SYNC_COUNT_STEPS:
            self.finish()
            if self.recorder is not None:
                self.recorder.start()
        if self.recorder is not None and step == self.profile_ends_at:
            self.recorder.stop()
        if step == self.warmup_steps:
            synchronize(self.device)
            self._started = time.perf_counter()
        elif step == self.timing_ends_at and self._started is not None:
            synchronize(self.device)
            self.step_time = (time.perf_counter() - self._started) / (self.timing_ends_at - self.warmup_steps)
            self._syncs = count_host_syncs().__enter__()

    def finish(self) -> None:
        """Close the host-sync count if it is still open."""
        if self._syncs is not None:
            self._syncs.__exit__(None, None, None)
            self.sync_count, self._syncs = self._syncs.count, None


def train(
    model: LightningModule,
    datamodule: LightningDataModule,
    trainer_settings: Any,
    warmup_steps: int,
    compile_options: dict,
    profile: Path | None = None,
) -> dict:
    """Train as the module docstring says; return the row's numbers (``BenchProbe``'s keys). With ``profile`` (the
    files' stem), record ``PROFILE_STEPS`` steps after the host-sync count, as ``BenchProbe`` does."""
    precision = str(trainer_settings.precision)
    if precision not in PRECISIONS:
        raise ValueError(f"hand-loop: precision {precision!r} is not run; accepted: {', '.join(PRECISIONS)}")
    device = trainer_settings.strategy.root_device  # the recipe's accelerator, one device
    max_steps, accumulate = trainer_settings.max_steps, trainer_settings.accumulate_grad_batches
    clip = trainer_settings.gradient_clip_val
    model.to(device=device, dtype=torch.bfloat16 if precision == "bf16-true" else None)
    model.train()
    optimizer, scheduler = _optimizer_and_scheduler(model.configure_optimizers())
    fuse_optimizer(optimizer)
    forward = torch.compile(model, **compile_options)
    cuda_graphs = compile_options.get("mode") in CUDA_GRAPH_MODES
    datamodule.setup("fit")
    batches = _batches(datamodule.train_dataloader())

    schedule = _Schedule(device, max_steps, warmup_steps, profile)
    tail_from = max_steps - max(1, max_steps // TAIL_FRACTION)
    last_loss = tail_sum = None
    tail_batches = tokens_per_step = samples_per_step = 0
    for step in range(max_steps):
        schedule.step_starts(step)
        tokens_per_step = samples_per_step = 0
        for _ in range(accumulate):
            inputs, targets = _to(next(batches), device)
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten
            with _autocast(precision, device):
                loss = forward(inputs, targets)
            (loss / accumulate).backward()
            last_loss = loss.detach().clone()  # a CUDA graph's output lives only until its next replay
            if step >= tail_from:
                tail_sum = last_loss.float() if tail_sum is None else tail_sum + last_loss.float()
                tail_batches += 1
            tokens_per_step += inputs.numel()
            samples_per_step += inputs.shape[0]
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    schedule.finish()
    held_out, held_out_batches = _held_out_loss(model, datamodule, precision, device)
    peak, peak_kind = peak_memory_bytes(device)
    step_time = schedule.step_time
    tokens_per_s = tokens_per_step / step_time if step_time else None
    flops_per_token = getattr(model, "flops_per_token", None)
    peak_flops = peak_flops_per_device(device)
    return {
        "steps": max_steps,
        "step_time_s": step_time,
        "samples_per_s": samples_per_step / step_time if step_time else None,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": peak_flops,
        "mfu": model_flops_utilization(tokens_per_s, flops_per_token, 1, peak_flops),
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "peak_memory_bytes_max_rank": peak,
        "comm_bytes_per_step": None,
        "comm_bytes_by_collective": None,
        "exposed_comm_s": None,
        "host_syncs_per_step": schedule.sync_count / SYNC_COUNT_STEPS if schedule.sync_count is not None else None,
        "final_loss": last_loss.item() if last_loss is not None else None,
        "tail_loss": (tail_sum / tail_batches).item() if tail_sum is not None else None,
        "held_out_loss": held_out,
        "held_out_batches": held_out_batches,
        "optimizer_fused": bool(getattr(optimizer, "_step_supports_amp_scaling", False)),
    }


@torch.no_grad()
def _held_out_loss(
    model: LightningModule, datamodule: LightningDataModule, precision: str, device: torch.device
) -> tuple[float | None, int]:
    """The mean loss of the trained model on the first ``HELD_OUT_BATCHES`` validation batches, as bench's rows."""
    model.eval()
    losses = []
    for index, batch in enumerate(datamodule.val_dataloader()):
        if index == HELD_OUT_BATCHES:
            break
        inputs, targets = _to(batch, device)
        with _autocast(precision, device):
            losses.append(model(inputs, targets).float())
    model.train()
    return (torch.stack(losses).mean().item() if losses else None), len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fastdist.commands.bench.hand_loop", description=__doc__)
    parser.add_argument("--output", required=True, help="the row's JSON file")
    parser.add_argument("--warmup-steps", type=int, default=2, help="optimizer steps left out of the timing")
    parser.add_argument("--compile", default="{}", help="torch.compile keyword arguments, as JSON")
    parser.add_argument("--profile", action="store_true", help="record a few steps with torch.profiler (bench's)")
    own, fit_arguments = parser.parse_known_args(argv)
    if fit_arguments[:1] == ["--"]:
        fit_arguments = fit_arguments[1:]
    model, datamodule, trainer = read_run(fit_arguments)
    output = Path(own.output)
    profile = output.with_suffix("") if own.profile else None
    row = train(model, datamodule, trainer, own.warmup_steps, json.loads(own.compile), profile)
    output.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
