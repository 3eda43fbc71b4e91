"""What BottleneckReport costs outside its measuring window, and what the window itself costs (1 CPU process).

Part 1: the callback's per-batch hooks called directly, outside the window: nanoseconds per batch.
Part 2: TinyGPT fits with no report, with a report whose window lies beyond the run
(never measures), and with a report measuring the whole run; runs interleaved, fastest kept.

    python benchmarks/bottleneck_overhead.py
"""

from __future__ import annotations

import time

import lightning as L
import torch

from lightning_fastdist import BottleneckReport
from lightning_fastdist.demo import TextDataModule, TinyGPT

STEPS = 60
REPEATS = 3
HOOK_CALLS = 200_000


def hook_cost_ns() -> float:
    report = BottleneckReport(start_step=10**9)
    started = time.perf_counter_ns()
    for _ in range(HOOK_CALLS):
        report.on_train_batch_start(None, None, None, 0)
        report.on_before_optimizer_step(None, None, None)
        report.on_train_batch_end(None, None, None, None, 0)
    return (time.perf_counter_ns() - started) / HOOK_CALLS


def fit_seconds(report: BottleneckReport | None) -> float:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[report] if report else [], default_root_dir="/tmp/bottleneck_overhead",
    )  # fmt: skip
    model, data = TinyGPT(n_layer=2, n_embd=128, n_head=4, block_size=64), TextDataModule(batch_size=16, block_size=64)
    started = time.perf_counter()
    trainer.fit(model, data)
    return time.perf_counter() - started


def main() -> None:
    print(f"Hooks outside the window: {hook_cost_ns():.0f} ns per batch (3 hook calls)")
    setups = {
        "no report": lambda: None,
        "report, window beyond the run": lambda: BottleneckReport(start_step=10**9),
        "report measuring (40 timed + 10 sync-counted batches)": lambda: BottleneckReport(
            start_step=5, num_steps=40, host_sync_steps=10
        ),
    }
    best = {name: float("inf") for name in setups}
    for _ in range(REPEATS):
        for name, make in setups.items():
            best[name] = min(best[name], fit_seconds(make()))
    base = best["no report"]
    print(f"TinyGPT 2x128, batch 16x64, {STEPS} steps, fastest of {REPEATS} interleaved fits:")
    for name, seconds in best.items():
        print(f"  {name:55s} {seconds:6.2f} s  ({seconds / base - 1:+.1%})")


if __name__ == "__main__":
    main()
