"""BenchProbe: the callback ``lightning-fastdist bench`` adds to every setup it trains.

It measures without a per-step device sync: speed, bytes and exposed communication over a timed window after
warm-up, host syncs after the window (counting slows dispatch), and held-out loss once after the last step, outside
the window. Rank 0 writes the numbers as JSON (``docs/bench.md``). Lightning's own strategies time and count nothing,
so the probe attaches our counters to them without changing what they compute.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.callbacks.speed_monitor import default_units
from lightning_fastdist.commands.bench.measures import (
    model_flops_utilization,
    peak_flops_per_device,
    peak_memory_bytes,
    synchronize,
)
from lightning_fastdist.commands.bench.step_profile import PROFILE_STEPS, StepProfile
from lightning_fastdist.diagnostics.host_syncs import HostSyncCounter, count_host_syncs
from lightning_fastdist.parallel.comm.accounting import CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, watch_ddp
from lightning_fastdist.parallel.deepspeed.comm_accounting import count_deepspeed_communication
from lightning_fastdist.parallel.fsdp.comm_accounting import count_fsdp_communication
from lightning_fastdist.strategies.across_nodes import TorchftForm

SYNC_COUNT_STEPS = 2
TAIL_FRACTION = 4  # tail_loss averages the last 1/TAIL_FRACTION of the optimizer steps (at least one)
HELD_OUT_BATCHES = 8  # micro-batches of held-out data per rank of the job, evaluated once after the last step
HELD_OUT_METRIC = "val_loss"  # what the model logs in validation_step (TinyGPT's name)


class BenchProbe(L.Callback):
    """Measure one benchmark setup and write its numbers to ``output`` (rank 0).

    Args:
        output: the JSON file rank 0 writes.
        warmup_steps: steps left out of the timing window (compilation, allocator warm-up).
        held_out_batches: micro-batches of held-out data per rank evaluated after the last step (0: none); the
            job evaluates ``held_out_batches x world size`` in all, the same samples for every setup.
        profile: record ``PROFILE_STEPS`` steps after the host-sync count with ``torch.profiler``, beside ``output``
            (``step_profile.py``).
    """

    def __init__(
        self, output: str, warmup_steps: int = 2, held_out_batches: int = HELD_OUT_BATCHES, profile: bool = False
    ) -> None:
        self.output = Path(output)
        self.warmup_steps = warmup_steps
        self.profile_steps = PROFILE_STEPS if profile else 0
        self._profile: StepProfile | None = None
        self.held_out_batches = held_out_batches
        self._held_out_loss: torch.Tensor | None = None
        self._held_out_seen = 0  # batches this rank evaluated
        self._window_start: float | None = None
        self._window_steps = 0
        self._step_time: float | None = None
        self._units_per_step: dict[str, int] = {}
        self._syncs: HostSyncCounter | None = None
        self._sync_count: int | None = None  # syncs over SYNC_COUNT_STEPS whole steps
        self._last_loss: torch.Tensor | None = None
        self._tail_sum: torch.Tensor | None = None  # on the device: summed without a host sync
        self._tail_batches = 0
        self._clock: ExposedCommClock | None = None
        # What the probe measures itself, for a Lightning strategy (it closes their steps).
        self._own_clock: ExposedCommClock | None = None
        self._own_stats: CommStats | None = None
        self._stop_measuring: Callable[[], None] | None = None
        self._started_step: int | None = None  # the optimizer step the current micro-batch belongs to
        self._exposed_at_start: float | None = None
        self._exposed_per_step: float | None = None
        self._bytes_at_start: dict[str, int] = {}
        self._bytes_per_step: dict[str, float] | None = None  # per collective, averaged over the timed steps

    @property
    def exposed_comm(self) -> ExposedCommClock | None:
        """The clock this probe reads: the strategy's ``exposed_comm``, or its own on one of Lightning's strategies."""
        return self._clock

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock = getattr(trainer.strategy, "exposed_comm", None)
        if self._clock is None:
            self._measure_lightnings_own(trainer, pl_module)

    def _measure_lightnings_own(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Attach our clock and counters to one of Lightning's strategies: hooks on DDP's module, counting
        collectives on FSDP2's units, the counting backend on DeepSpeed."""
        strategy, clock, stats = trainer.strategy, ExposedCommClock(pl_module.device), CommStats()
        units = [module for module in pl_module.modules() if isinstance(module, FSDPModule)]
        if isinstance(strategy.model, DistributedDataParallel):  # its bytes stay uncounted: no hook of ours sees them
            self._stop_measuring = watch_ddp(strategy.model, clock).remove
        elif units and count_fsdp_communication(units, stats, replicated=False, clock=clock):
            self._own_stats = stats
        elif isinstance(strategy, DeepSpeedStrategy):
            self._stop_measuring = count_deepspeed_communication(stats, clock)
            self._own_stats = stats
        else:
            return
        self._clock = self._own_clock = clock

    def _timing_ends_at(self, trainer: L.Trainer) -> int:
        return max(trainer.max_steps - SYNC_COUNT_STEPS - self.profile_steps - 1, self.warmup_steps + 1)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._started_step:  # a later micro-batch of the same optimizer step (accumulation)
            return
        self._started_step = step
        if self._syncs is not None and step == self._timing_ends_at(trainer) + SYNC_COUNT_STEPS:
            self._syncs.__exit__(None, None, None)
            self._sync_count = self._syncs.count
            if self.profile_steps:
                self._profile = StepProfile(self.output.with_suffix(""), pl_module.device)
                self._profile.start()
        if self._profile is not None and step == self._timing_ends_at(trainer) + SYNC_COUNT_STEPS + self.profile_steps:
            self._profile.stop(write=trainer.is_global_zero)
            self._profile = None
        if step == self.warmup_steps:
            synchronize(pl_module.device)
            self._window_start = time.perf_counter()
            self._exposed_at_start = self._clock.total_s if self._clock is not None else None  # the events are done
            self._bytes_at_start = _bytes_so_far(self._comm_stats(trainer))
        elif step == self._timing_ends_at(trainer) and self._window_start is not None:
            synchronize(pl_module.device)
            self._step_time = (time.perf_counter() - self._window_start) / self._window_steps
            if self._exposed_at_start is not None:
                self._exposed_per_step = (self._clock.total_s - self._exposed_at_start) / self._window_steps
            stats = self._comm_stats(trainer)
            if stats is not None:
                self._bytes_per_step = {
                    name: (count - self._bytes_at_start.get(name, 0)) / self._window_steps
                    for name, count in _bytes_so_far(stats).items()
                }
            self._syncs = count_host_syncs()
            self._syncs.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ranks_and_micro_batches = trainer.world_size * trainer.accumulate_grad_batches
        self._units_per_step = {unit: n * ranks_and_micro_batches for unit, n in default_units(batch).items()}
        if trainer.global_step != self._started_step:  # this micro-batch closed its optimizer step
            if self._window_start is not None and self._step_time is None:
                self._window_steps += 1
            for own in (self._own_stats, self._own_clock):
                if own is not None:
                    own.end_step()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning hands this hook the loss divided by accumulate_grad_batches (what the backward sees): undo it.
        self._last_loss = loss.detach() * trainer.accumulate_grad_batches
        if self._started_step >= trainer.max_steps - max(1, trainer.max_steps // TAIL_FRACTION):  # the last quarter
            loss = self._last_loss.float()
            self._tail_sum = loss if self._tail_sum is None else self._tail_sum + loss
            self._tail_batches += 1
        if trainer.global_step == trainer.max_steps:  # the last optimizer step is done
            self._validate_after_the_last_step(trainer)

    def _validate_after_the_last_step(self, trainer: L.Trainer) -> None:
        """Have Lightning validate once now (bench's overlay sets ``limit_val_batches: 0``, so the timed steps hold
        none): it validates before a fit that is asked to stop ends, whatever the recipe's validation interval."""
        trainer.limit_val_batches = self.held_out_batches * trainer.world_size // evaluating_ranks(trainer)
        trainer.check_val_every_n_epoch = None  # not only at the end of some epochs
        trainer.should_stop = True

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._held_out_seen += 1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._held_out_loss = trainer.callback_metrics.get(HELD_OUT_METRIC)  # reduced over the evaluating ranks

    def _comm_stats(self, trainer: L.Trainer) -> CommStats | None:
        return getattr(trainer.strategy, "comm_stats", None) or self._own_stats

    def _per_second(self, unit: str) -> float | None:
        count = self._units_per_step.get(unit)
        return count / self._step_time if count and self._step_time else None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak, peak_kind = peak_memory_bytes(pl_module.device)
        if self._stop_measuring is not None:
            self._stop_measuring()
        flops_per_token = getattr(pl_module, "flops_per_token", None)
        peak_flops = peak_flops_per_device(pl_module.device)
        result = {
            "steps": trainer.global_step,
            "step_time_s": self._step_time,
            "samples_per_s": self._per_second("samples"),
            "tokens_per_s": self._per_second("tokens"),
            "flops_per_token": flops_per_token,
            "peak_flops_per_device": peak_flops,
            "mfu": model_flops_utilization(self._per_second("tokens"), flops_per_token, trainer.world_size, peak_flops),
            "peak_memory_bytes": peak,
            "peak_memory_kind": peak_kind,
            "comm_bytes_per_step": sum(per_step.values()) if (per_step := self._bytes_per_step) is not None else None,
            "comm_bytes_by_collective": self._bytes_per_step,
            "exposed_comm_s": self._exposed_per_step,
            "host_syncs_per_step": self._sync_count / SYNC_COUNT_STEPS if self._sync_count is not None else None,
            "final_loss": self._last_loss.item() if self._last_loss is not None else None,
            "tail_loss": (self._tail_sum / self._tail_batches).item() if self._tail_sum is not None else None,
            "held_out_loss": self._held_out_loss.item() if self._held_out_loss is not None else None,
            "held_out_batches": self._held_out_seen * evaluating_ranks(trainer),
        }
        per_rank = trainer.strategy.all_gather(torch.tensor(float(peak), device=pl_module.device))
        result["peak_memory_bytes_max_rank"] = int(per_rank.max().item()) if per_rank.dim() else peak
        if trainer.is_global_zero:
            self.output.write_text(json.dumps(result, indent=2))


def evaluating_ranks(trainer: L.Trainer) -> int:
    """The ranks one evaluation's data is shared out over: every rank of the job, or with a world per node each node's
    own (every node evaluates all of it, on the same global weights: ``docs/outer-sync.md``)."""
    world_per_node = isinstance(getattr(trainer.strategy, "across_nodes", None), TorchftForm)
    return trainer.num_devices if world_per_node else trainer.world_size


def _bytes_so_far(stats: CommStats | None) -> dict[str, int]:
    """Bytes of each collective since ``stats`` started counting (empty if nothing counts)."""
    return {name: traffic.bytes for name, traffic in stats.totals.items()} if stats is not None else {}
