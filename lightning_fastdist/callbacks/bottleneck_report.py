"""BottleneckReport: measure a window of training steps and print a checklist with a fix per finding.

Host syncs are counted in batches of their own after the timed window, because counting slows every op. Each rank
measures; the worst rank is reported. Outside the windows each hook is one integer comparison.
"""

from __future__ import annotations

import resource
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastdist.callbacks.speed_monitor import training_ranks
from lightning_fastdist.callbacks.step_clock import clock_for
from lightning_fastdist.diagnostics import bottleneck_checks as checks
from lightning_fastdist.diagnostics.comm_probe import time_collectives
from lightning_fastdist.diagnostics.dataloader_audit import workers_for
from lightning_fastdist.diagnostics.environment import bf16_available, cpu_cores, host_memory_bytes
from lightning_fastdist.diagnostics.host_syncs import HostSyncCounter, count_host_syncs
from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.comm.accounting import ALL_GATHER, CommStats, Traffic
from lightning_fastdist.parallel.ddp.buckets import gradient_bytes

KIB = 1024


@dataclass
class _BatchMarks:
    start: Any
    before_optimizer: Any = None
    end: Any = None
    after_pause: bool = False  # validation ran before this batch: its gap is no data wait


class BottleneckReport(Callback):
    """Measure a window of steps; print a checklist (measured, OK/WARN, fix as YAML); write it as JSON and Markdown.

    Args:
        start_step: training batches to skip before measuring (warm-up, compilation).
        num_steps: batches in the timed window (>= 2).
        host_sync_steps: batches counted for host syncs after the timed window (>= 1).
        filename: stem of the ``.json`` and ``.md`` files rank 0 writes into the log directory.
    """

    def __init__(
        self, start_step: int = 10, num_steps: int = 20, host_sync_steps: int = 5, filename: str = "bottleneck_report"
    ) -> None:
        for name, value, minimum in (
            ("start_step", start_step, 0),
            ("num_steps", num_steps, 2),
            ("host_sync_steps", host_sync_steps, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"BottleneckReport: {name} must be an integer >= {minimum}, got {value!r}.")
        if not filename or "/" in filename:
            raise ValueError(f"BottleneckReport: filename must be a non-empty file stem without '/', got {filename!r}.")
        self.start_step = start_step
        self.num_steps = num_steps
        self.host_sync_steps = host_sync_steps
        self.filename = filename
        self.rows: list[checks.CheckRow] = []
        self.details: dict = {}
        self.paths: list[Path] = []
        self._batch = 0
        self._timing_end = start_step + num_steps
        self._end = self._timing_end + host_sync_steps
        self._clock = clock_for(torch.device("cpu"))
        self._marks: list[_BatchMarks] = []
        self._paused = False
        self._counter: HostSyncCounter | None = None
        self._counting = False
        self._watcher = RecompileWatcher(report=lambda message: None)
        self._at_start: dict = {}
        self._timing: dict = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock = clock_for(trainer.strategy.root_device)
        self._batch = 0
        self._paused = False
        self._marks.clear()
        self.rows, self.details, self.paths = [], {}, []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.start_step <= self._batch < self._end:
            return
        if self._batch < self._timing_end:
            if self._batch == self.start_step:
                self._open_timing(trainer)
            self._marks.append(_BatchMarks(self._clock.mark(), after_pause=self._paused))
            self._paused = False
            return
        if self._batch == self._timing_end:
            self._counter = count_host_syncs(device="cuda" if trainer.strategy.root_device.type == "cuda" else "cpu")
            self._counter.__enter__()
            self._counting = True
        if self._counting:
            self._counter.label = self._batch

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.start_step <= self._batch < self._timing_end and self._marks:
            self._marks[-1].before_optimizer = self._clock.mark()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        batch_number = self._batch
        self._batch += 1
        if not self.start_step <= batch_number < self._end:
            return
        if batch_number < self._timing_end:
            self._marks[-1].end = self._clock.mark()
            if batch_number == self._timing_end - 1:
                self._close_timing(trainer, pl_module)
        elif batch_number == self._end - 1 and self._counting:
            self._stop_measuring()
            self._finish(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._paused = True

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_measuring()
        if not self.rows:
            rank_zero_info(
                f"BottleneckReport: training ended after {self._batch} batches, before the window "
                f"(batches {self.start_step}-{self._end - 1}) was complete; no report. Lower start_step/num_steps."
            )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_measuring()

    def _open_timing(self, trainer: Trainer) -> None:
        stats = _comm_stats(trainer)
        self._at_start = {
            "global_step": trainer.global_step,
            "rounds": stats.rounds if stats is not None else None,
            "totals": dict(stats.totals) if stats is not None else None,
        }
        self._watcher.start()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def _close_timing(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_measuring()
        self._clock.resolve()
        seconds = self._clock.seconds
        waits = [seconds(prev.end, cur.start) for prev, cur in zip(self._marks, self._marks[1:]) if not cur.after_pause]
        steps = [seconds(m.start, m.end) for m in self._marks]
        optimizer = [seconds(m.before_optimizer, m.end) for m in self._marks if m.before_optimizer is not None]
        optimizer_steps = trainer.global_step - self._at_start["global_step"]
        stats = _comm_stats(trainer)
        rounds = step_traffic = None
        if stats is not None and self._at_start["totals"] is not None:
            rounds = stats.rounds - self._at_start["rounds"]
            step_traffic = self._traffic_per_step(stats, optimizer_steps)
        model = trainer.strategy.model
        bucket_bytes = getattr(model, "bucket_bytes_cap", None) if isinstance(model, DistributedDataParallel) else None
        comm_s, why = None, ""
        if step_traffic is None:
            why = "communication is counted by FastDDPStrategy and FastFSDPStrategy only"
        elif trainer.world_size < 2:
            why = "a single process has nothing to communicate"
        else:
            comm_s = time_collectives(step_traffic, trainer.strategy.root_device)
        self._timing = {
            "wait_fraction": sum(waits) / (sum(waits) + sum(steps)) if steps else 0.0,
            "mean_wait_s": statistics.fmean(waits) if waits else 0.0,
            "loop_s": sum(waits) + sum(steps),
            "optimizer_s": sum(optimizer),
            "optimizer_steps": optimizer_steps,
            "rounds": rounds,
            "step_bytes": sum(t.bytes for t in step_traffic.values()) if step_traffic is not None else None,
            "sharded": step_traffic is not None and ALL_GATHER in step_traffic,
            "comm_s": comm_s,
            "comm_unmeasured": why,
            "bucket_bytes": bucket_bytes,
            "gradient_bytes": gradient_bytes(pl_module),
            "recompiles": self._watcher.count,
            **self._peak_memory(trainer),
        }

    def _traffic_per_step(self, stats: CommStats, optimizer_steps: int) -> dict[str, Traffic]:
        """Each collective's calls and bytes in the window, divided by its optimizer steps."""
        steps = max(1, optimizer_steps)
        window = {name: total - self._at_start["totals"].get(name, Traffic()) for name, total in stats.totals.items()}
        return {name: Traffic(t.calls // steps, t.bytes // steps) for name, t in window.items() if t.calls}

    def _peak_memory(self, trainer: Trainer) -> dict:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            peak, what = torch.cuda.max_memory_allocated(device), "allocated on the GPU"
            capacity = torch.cuda.get_device_properties(device).total_memory
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB  # Linux reports KiB
            capacity, what = host_memory_bytes(), "peak RSS of this process vs host memory"
        return {"peak_bytes": peak, "capacity_bytes": capacity, "memory_what": what}

    def _stop_measuring(self) -> None:
        if self._counting:
            self._counter.__exit__(None, None, None)
            self._counting = False
        self._watcher.stop()  # a no-op when it is not watching

    def _finish(self, trainer: Trainer) -> None:
        assert self._counter is not None
        per_step = self._counter.counts_by_label()
        counts = [per_step.get(b, 0) for b in range(self._timing_end, self._end)]
        origins = Counter(event.origin for event in self._counter.events)
        mine = {
            **self._timing,
            "rank": trainer.global_rank,
            "syncs_median": statistics.median(counts),
            "syncs_per_step": counts,
            "top_sync_origin": origins.most_common(1)[0][0] if origins else None,
        }
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(ranks, mine)
        self.rows = self._rows(trainer, ranks)
        window = {"start_step": self.start_step, "num_steps": self.num_steps, "host_sync_steps": self.host_sync_steps}
        self.details = {"window": window, "ranks": ranks}
        # log_dir is a collective under DDP: every rank asks
        directory = Path(trainer.log_dir or trainer.default_root_dir)
        if trainer.is_global_zero:
            self._write(trainer, directory)

    def _rows(self, trainer: Trainer, ranks: list[dict]) -> list[checks.CheckRow]:
        slowest_data = max(ranks, key=lambda r: r["wait_fraction"])
        most_syncs = max(ranks, key=lambda r: r["syncs_median"])
        optimizer_heavy = max(ranks, key=lambda r: r["optimizer_s"] / r["loop_s"] if r["loop_s"] else 0.0)
        peak = max(ranks, key=lambda r: r["peak_bytes"] or 0)
        first = ranks[0]
        steps = max(1, first["optimizer_steps"])
        comm_s = max((r["comm_s"] for r in ranks if r["comm_s"] is not None), default=None)
        device_type = trainer.strategy.root_device.type
        return [
            checks.check_data_wait(
                slowest_data["wait_fraction"],
                slowest_data["mean_wait_s"],
                workers_for(cpu_cores() // max(1, trainer.num_devices)),
            ),
            checks.check_host_syncs(most_syncs["syncs_median"], most_syncs["top_sync_origin"]),
            checks.check_buckets(first["bucket_bytes"], first["gradient_bytes"]),
            checks.check_comm_rounds(first["rounds"], first["optimizer_steps"]),
            checks.check_comm_time(
                comm_s, max(r["loop_s"] for r in ranks) / steps, first["comm_unmeasured"], sharded=first["sharded"]
            ),
            checks.check_optimizer_time(optimizer_heavy["optimizer_s"], optimizer_heavy["loop_s"]),
            checks.check_memory(peak["peak_bytes"], peak["capacity_bytes"], peak["memory_what"]),
            checks.check_recompiles(max(r["recompiles"] for r in ranks)),
            checks.check_precision(str(trainer.precision), bf16_available(device_type), device_type),
        ]

    def _write(self, trainer: Trainer, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        ranks, training = trainer.world_size, training_ranks(trainer)
        of = f"{training} of {ranks} rank(s) training at the end" if training != ranks else f"{ranks} rank(s)"
        title = f"Bottleneck report (batches {self.start_step}-{self._end - 1}, {of})"
        json_path, markdown_path = directory / f"{self.filename}.json", directory / f"{self.filename}.md"
        json_path.write_text(checks.render_json(self.rows, self.details))
        markdown_path.write_text(checks.render_markdown(self.rows, title))
        self.paths = [json_path, markdown_path]
        print(f"{title}\n{checks.render_text(self.rows)}\nWritten to {json_path} and {markdown_path}", flush=True)


def _comm_stats(trainer: Trainer) -> CommStats | None:
    """The strategy's byte counts, where it keeps them (our strategies do; Lightning's do not)."""
    return getattr(trainer.strategy, "comm_stats", None)
