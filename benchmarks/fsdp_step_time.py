"""Step time of FastFSDPStrategy ZeRO-3 against Lightning's ModelParallelStrategy with hand-written fully_shard.

Lightning's row is ``ModelParallelStrategy`` (every rank data-parallel) training ``HandShardedTinyGPT``,
whose ``configure_model`` calls ``fully_shard`` per block and on the module (``commands/bench/baselines.py``,
the ``lightning-fsdp2`` row of ``bench``); ours is ``FastFSDPStrategy(sharding="zero3")`` on the unchanged
TinyGPT. The model and batch are the cpu_smoke recipe's (4 layers, width 128, 16 x 128 tokens per rank),
in fp32 on 2 CPU processes over gloo.

On this machine a setup's speed depends on when it runs (what ran just before it, the machine's load),
so both setups train in the same two processes, each pinned to a core of its own, in alternating
order, for ``--rounds`` rounds. A step is timed from its start to the next step's start, so the
loop's per-batch work counts too. Each round gives the ratio of the two median step times, and
the result is the geometric mean of those ratios (below 1: ours is faster). The same is printed
for the CPU time rank 0's process spends per step (its threads' work, without the time it waits
to be scheduled).

    python benchmarks/fsdp_step_time.py [--rounds 4] [--steps 40]

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
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_fastdist import FastFSDPStrategy
from lightning_fastdist.commands.bench.baselines import HandShardedTinyGPT
from lightning_fastdist.demo import TextDataModule, TinyGPT

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
SETUPS = {
    "lightning ModelParallelStrategy": lambda: (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        HandShardedTinyGPT(**MODEL),
    ),
    "fast_fsdp zero3": lambda: (FastFSDPStrategy(sharding="zero3"), TinyGPT(**MODEL)),
}
WARMUP_STEPS = 5


class StepClock(L.Callback):
    """Wall and process CPU time from one training step's start to the next one's: everything the loop does per
    step (fetching the batch, Lightning's per-batch SIGTERM broadcast or our stop agreement, logging) counts.
    CPU-only, so reading the clocks costs no device sync."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now


def median_step_times(setup: str, steps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of one training step of ``setup``, after the warm-up steps."""
    L.seed_everything(0, verbose=False)
    strategy, model = SETUPS[setup]()
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[clock],
    )  # fmt: skip
    trainer.fit(model, TextDataModule(batch_size=16, block_size=128))
    return statistics.median(clock.wall[WARMUP_STEPS:]), statistics.median(clock.cpu[WARMUP_STEPS:])


def benchmark(rounds: int, steps: int) -> None:
    names = list(SETUPS)
    lightning, ours = names
    ratios: dict[str, list[float]] = {"wall": [], "CPU": []}
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        times = {name: median_step_times(name, steps) for name in order}
        for i, clock in enumerate(ratios):
            ratios[clock].append(times[ours][i] / times[lightning][i])
        if int(os.environ["RANK"]) == 0:
            print(
                f"round {round_ + 1} ({order[0]} first): wall {times[lightning][0] * 1e3:.1f} / "
                f"{times[ours][0] * 1e3:.1f} ms, CPU {times[lightning][1] * 1e3:.1f} / {times[ours][1] * 1e3:.1f} ms "
                f"(Lightning / ours)",
                flush=True,
            )
    if int(os.environ["RANK"]) == 0:
        for clock, values in ratios.items():
            ratio = statistics.geometric_mean(values)
            print(f"{ours} / {lightning} {clock} time per step: {ratio:.3f} ({rounds} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # not yet launched: start 2 ranks of this script
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", __file__]
        sys.exit(subprocess.call([*command, "--rounds", str(args.rounds), "--steps", str(args.steps)]))
    torch.set_num_threads(1)
    # Each rank (and its gloo threads) on a core of its own: the two ranks do not trade cores mid-step.
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
    benchmark(args.rounds, args.steps)


if __name__ == "__main__":
    main()
