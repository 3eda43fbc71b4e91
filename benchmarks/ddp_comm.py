"""Gradient compression on 2 CPU processes (gloo): bytes per step, step time and loss, per comm hook.

Trains TinyGPT (default size) for the same steps and data under Lightning's
plain DDPStrategy and under FastDDPStrategy with each hook, in one run, and
prints one row per setup:
- bytes/step: payload each rank all-reduced per optimizer step (measured by the hook);
- step time: median wall time of a training step after 5 warm-up steps, and its
  ratio to plain DDPStrategy;
- loss: mean train loss over the last 10 steps, and its difference to no hook.

    python benchmarks/ddp_comm.py [--steps 80]

It re-runs itself under torchrun with 2 processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_fastdist import FastDDPStrategy
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.parallel.ddp.buckets import gradient_bytes

SETUPS = [
    ("lightning DDPStrategy", lambda: DDPStrategy()),
    ("fast_ddp none", lambda: FastDDPStrategy(comm_hook="none")),
    ("fast_ddp fp16", lambda: FastDDPStrategy(comm_hook="fp16")),
    ("fast_ddp bf16", lambda: FastDDPStrategy(comm_hook="bf16")),
    ("fast_ddp powersgd r2", lambda: FastDDPStrategy(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=10)),
    ("fast_ddp powersgd r8", lambda: FastDDPStrategy(comm_hook="powersgd", powersgd_rank=8, powersgd_start_iter=10)),
    (
        "fast_ddp powersgd r8 fp16 factors",
        lambda: FastDDPStrategy(
            comm_hook="powersgd", powersgd_rank=8, powersgd_start_iter=10, powersgd_factor_dtype="fp16"
        ),
    ),
    (
        "fast_ddp powersgd r8 bf16 factors",
        lambda: FastDDPStrategy(
            comm_hook="powersgd", powersgd_rank=8, powersgd_start_iter=10, powersgd_factor_dtype="bf16"
        ),
    ),
]
WARMUP_STEPS = 5
LOSS_WINDOW = 10


class StepRecorder(L.Callback):
    """Wall time and loss of every step; CPU-only, so reading the clock costs no device sync."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self.bytes: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(outputs["loss"].item())
        state = getattr(trainer.strategy, "hook_state", None)
        if state is not None:
            self.bytes.append(state.stats.last_step_bytes)


def run_setup(make_strategy, steps: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = TinyGPT()
    recorder = StepRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(model, TextDataModule())
    compressed_bytes = recorder.bytes[-1] if recorder.bytes else gradient_bytes(model)
    return {
        "bytes": compressed_bytes,
        "step_time": statistics.median(recorder.times[WARMUP_STEPS:]),
        "loss": statistics.fmean(recorder.losses[-LOSS_WINDOW:]),
    }


def benchmark(steps: int) -> None:
    results = {name: run_setup(make, steps) for name, make in SETUPS}
    if int(os.environ["RANK"]) != 0:
        return
    baseline, no_hook = results["lightning DDPStrategy"], results["fast_ddp none"]
    print(
        f"\nTinyGPT {gradient_bytes(TinyGPT()) / 2**20:.2f} MiB of fp32 gradients, "
        f"2 CPU processes (gloo), {steps} steps"
    )
    print(f"{'setup':34} {'bytes/step':>12} {'vs none':>8} {'step ms':>8} {'vs DDP':>7} {'loss':>7} {'d loss':>7}")
    for name, r in results.items():
        print(
            f"{name:34} {r['bytes']:>12,} {r['bytes'] / no_hook['bytes']:>8.3f} {1000 * r['step_time']:>8.1f} "
            f"{r['step_time'] / baseline['step_time']:>7.2f} {r['loss']:>7.3f} {r['loss'] - no_hook['loss']:>+7.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # not yet launched: start 2 ranks of this script
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", __file__]
        sys.exit(subprocess.call([*command, "--steps", str(args.steps)]))
    torch.set_num_threads(1)
    benchmark(args.steps)


if __name__ == "__main__":
    main()
