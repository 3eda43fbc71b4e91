"""Host syncs per step and step time: plain Lightning vs the sync-free stack, same model, one run.

Both configurations train TinyGPT with bf16 autocast on 2 CPU processes (gloo),
logging ``train_loss`` with ``prog_bar=True`` every step under the default
progress bar:

- plain: ``strategy="ddp"``, ``precision="bf16-mixed"``;
- ours: ``FastDDPStrategy`` + ``FastMixedPrecision("bf16-mixed")`` +
  ``SyncFreeLogging`` + ``SpeedMonitor``.

Each configuration runs twice: once inside :func:`count_host_syncs` (CPU
standing in for a GPU) to count syncs per step, once without it to time steps
(the counter's dispatch hooks slow every op). On CPU a "sync" costs nothing,
so the step times here show only the bookkeeping; on a GPU each sync stalls
the host until the device drains.

    python benchmarks/host_syncs.py [--steps 60] [--log-every 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L

from lightning_fastdist import FastDDPStrategy, FastMixedPrecision, SpeedMonitor, SyncFreeLogging, count_host_syncs
from lightning_fastdist.demo import TextDataModule, TinyGPT

WARMUP_STEPS = 5


class StepClock(L.Callback):
    """Wall time between consecutive training batch starts, and the counter's label per step."""

    def __init__(self, syncs=None) -> None:
        self.syncs = syncs
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        if self.syncs is not None:
            self.syncs.label = trainer.global_step


def fit(ours: bool, steps: int, log_every: int, count: bool) -> StepClock:
    syncs = count_host_syncs(device="cpu") if count else None
    clock = StepClock(syncs)
    extra = (
        dict(strategy=FastDDPStrategy(), plugins=[FastMixedPrecision("bf16-mixed")])
        if ours
        else dict(strategy="ddp", precision="bf16-mixed")
    )
    callbacks = [clock, SyncFreeLogging(), SpeedMonitor()] if ours else [clock]
    with tempfile.TemporaryDirectory(prefix="host-syncs-bench-") as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=steps, log_every_n_steps=log_every, default_root_dir=root,
            enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
            **extra,
        )  # fmt: skip
        L.seed_everything(0, verbose=False)
        model = TinyGPT(n_layer=2, n_embd=64, n_head=4, block_size=64)
        if syncs is None:
            trainer.fit(model, TextDataModule(batch_size=8, block_size=64))
        else:
            with syncs:
                trainer.fit(model, TextDataModule(batch_size=8, block_size=64))
    clock.syncs_per_step = syncs.counts_by_label() if syncs else None
    clock.is_global_zero = trainer.is_global_zero
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    lines = [f"{'config':6s} {'syncs/step (ordinary)':>22s} {'syncs/step (log)':>17s} {'step ms (median)':>17s}"]
    for ours in (False, True):
        counted = fit(ours, args.steps, args.log_every, count=True)
        timed = fit(ours, args.steps, args.log_every, count=False)
        per_step = counted.syncs_per_step
        log_steps = [s for s in range(args.steps) if (s + 1) % args.log_every == 0]
        ordinary = [per_step.get(s, 0) for s in range(WARMUP_STEPS, args.steps) if s not in log_steps]
        logging = [per_step.get(s, 0) for s in log_steps]
        gaps = [b - a for a, b in zip(timed.starts[WARMUP_STEPS:], timed.starts[WARMUP_STEPS + 1 :])]
        lines.append(
            f"{'ours' if ours else 'plain':6s} {statistics.mean(ordinary):22.2f} {statistics.mean(logging):17.2f} "
            f"{1000 * statistics.median(gaps):17.1f}"
        )
    if timed.is_global_zero:
        print(f"TinyGPT(n_layer=2, n_embd=64, block_size=64), batch 8 per rank, 2 CPU ranks, {args.steps} steps, "
              f"log_every_n_steps={args.log_every}")  # fmt: skip
        print("\n".join(lines))


if __name__ == "__main__":
    main()
