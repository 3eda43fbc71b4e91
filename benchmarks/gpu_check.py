"""Every GPU-only check in one short run, for when a GPU machine is lent (see gpu_check.sh).

Checks, each printing PASS/FAIL and its numbers:
1. sync-free: FastDDPStrategy (world size 1) + FastMixedPrecision bf16 + SyncFreeLogging +
   SpeedMonitor with torch.cuda.set_sync_debug_mode("error") on every step that is not a
   logging step: any device-to-host sync there raises.
2. bf16 AMP + compile: per-block inductor compile trains and the loss falls.
3. FSDP2 at world size 1 on the GPU (zero3 + activation checkpointing) trains.
4. MFU of TinyGPT at GPT-2-small shape (~124M parameters with embeddings), from SpeedMonitor.

    python benchmarks/gpu_check.py [--steps 60]
"""

from __future__ import annotations

import argparse
import sys
import time

import lightning as L
import torch

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy, FastMixedPrecision, SpeedMonitor, SyncFreeLogging
from lightning_fastdist.demo import TextDataModule, TinyGPT

LOG_EVERY = 10
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=512, vocab_size=50304)


class SyncsAreErrors(L.Callback):
    """Turn CUDA's sync debug mode to "error" for every step that is not a logging step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ordinary = (trainer.global_step + 1) % trainer.log_every_n_steps != 0 and trainer.global_step > 1
        torch.cuda.set_sync_debug_mode("error" if ordinary else "default")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")


class LossAndMetrics(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.mfu: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer._logger_connector.should_update_logs:  # log steps only: reading here is allowed
            self.losses.append(outputs["loss"].item())
            mfu = trainer.callback_metrics.get("speed/mfu")
            if mfu is not None:
                self.mfu.append(float(mfu))


def train(strategy, model_args: dict, steps: int, batch_size: int, extra_callbacks=()) -> LossAndMetrics:
    record = LossAndMetrics()
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, plugins=[FastMixedPrecision("bf16-mixed")],
        max_steps=steps, log_every_n_steps=LOG_EVERY, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[SyncFreeLogging(), SpeedMonitor(), *extra_callbacks, record],
    )  # fmt: skip
    data = TextDataModule(batch_size=batch_size, block_size=model_args["block_size"], num_workers=4)
    trainer.fit(TinyGPT(**model_args), data)
    return record


def check(name: str, passed: bool, detail: str) -> bool:
    print(f"[{'PASS' if passed else 'FAIL'}] {name}: {detail}", flush=True)
    return passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"CUDA {torch.version.cuda} | NCCL {torch.cuda.nccl.version()}"
    )
    small = dict(n_layer=4, n_head=4, n_embd=256, block_size=256)
    results = []

    try:
        run = train(FastDDPStrategy(), small, args.steps, 32, [SyncsAreErrors()])
        results.append(
            check("no host sync on ordinary steps", True, f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}")
        )
    except RuntimeError as error:
        results.append(check("no host sync on ordinary steps", False, str(error).splitlines()[0]))

    started = time.perf_counter()
    run = train(FastDDPStrategy(compile=True), small, args.steps, 32)
    results.append(check(
        "bf16 AMP + per-block inductor compile", run.losses[-1] < run.losses[0] - 0.5,
        f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f} in {time.perf_counter() - started:.0f} s with compile",
    ))  # fmt: skip

    run = train(FastFSDPStrategy(sharding="zero3", activation_checkpointing="full"), small, args.steps, 32)
    results.append(
        check(
            "FSDP2 world size 1",
            run.losses[-1] < run.losses[0] - 0.5,
            f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}",
        )
    )

    run = train(FastDDPStrategy(compile=True), GPT2_SMALL, args.steps, 16)
    mfu = run.mfu[-1] if run.mfu else float("nan")
    parameters = sum(p.numel() for p in TinyGPT(**GPT2_SMALL).parameters())
    results.append(
        check("MFU of TinyGPT at GPT-2 small", mfu == mfu, f"{parameters / 1e6:.0f}M parameters, MFU {mfu:.1%}")
    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
