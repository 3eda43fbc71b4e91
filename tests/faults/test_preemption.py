"""SIGTERM / SIGUSR1 on any subset of ranks: every rank stops at the same step, saves it, exits 128 + signal.

In-process runs (2 gloo ranks, one process group for many fits) send real
signals to rank 0 only, rank 1 only or both, at seeded random steps and at
different moments of a step: before the forward, inside the backward (while the
other rank may sit in DDP's gradient all-reduce: the deadlock of Lightning's
handler), before the optimizer step, during a checkpoint save and after the
batch. Each interrupted run must stop on both ranks at the same step with
``Preempted`` (exit status 143 / 138), leave ``last.ckpt`` holding exactly that
step, and the run resumed from it must end with weights equal to an
uninterrupted run's (dropout on: the random states are restored too). The same
holds for the sharded engines, FSDP2 (the fault campaign's trials, ``test_fault_campaign.py``) and DeepSpeed ZeRO-2.
Every other DDP case and two DeepSpeed cases save with ``async_checkpointing``: the stop's save waits for the one in
flight and is complete before the exit, and the resume equals the uninterrupted run with synchronous saves (FSDP's:
``tests/checkpoint/test_async_checkpoints.py``).

From outside, on the command line, the SLURM tests send the signals as SLURM delivers them to ``lightning-fastdist
fit``'s processes (``tests/slurm/test_stops_under_slurm.py``: every rank exits 143 and the requeued run resumes bit for
bit).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.trainer.preemption import EXIT_STATUS_BASE, Preempted
from tests.support.fault_runs import BATCH, BLOCK, saved_step, write_corpus
from tests.support.harness import run_function

pytestmark = pytest.mark.multiprocess

MAX_STEPS = 10
MOMENTS = ("forward", "backward", "optimizer_step", "save", "batch_end")


class SignalAt(L.Callback):
    """Send ``signum`` to this process once, on the listed ranks, at ``moment`` of optimizer step ``step``."""

    def __init__(self, step: int, ranks: tuple[int, ...], moment: str, signum: int = signal.SIGTERM) -> None:
        self.step, self.ranks, self.moment, self.signum = step, ranks, moment, signum
        self.sent = False

    def _send(self, trainer: L.Trainer, moment: str) -> None:
        if (
            not self.sent
            and moment == self.moment
            and trainer.global_step == self.step
            and trainer.global_rank in self.ranks
        ):
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._send(trainer, "forward")
        if self.moment == "backward" and trainer.global_step == self.step:
            # The last block's backward runs first: the signal lands while the rest of the backward (and, under
            # DDP, the gradient all-reduce) is still going on.
            block = module.blocks[-1]
            handle = block.register_full_backward_hook(
                lambda *_: (self._send(trainer, "backward"), handle.remove()) and None
            )

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._send(trainer, "optimizer_step")

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self._send(trainer, "save")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._send(trainer, "batch_end")


def local_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in module.state_dict().items()
    }


def make_strategy(kind: str, asynchronous: bool = False):
    if kind == "deepspeed":
        from lightning_fastdist import FastDeepSpeedStrategy  # noqa: PLC0415 - deepspeed is an optional extra

        return FastDeepSpeedStrategy(stage=2, timeout=60, async_checkpointing=asynchronous)
    strategy = FastDDPStrategy if kind == "ddp" else FastFSDPStrategy
    return strategy(timeout=60, async_checkpointing=asynchronous)


def fit(
    kind: str,
    corpus: str,
    folder: str,
    callbacks: list,
    resume: bool,
    accumulate: int = 1,
    asynchronous: bool = False,
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    strategy = make_strategy(kind, asynchronous)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=MAX_STEPS, deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[checkpoints, *callbacks], accumulate_grad_batches=accumulate,
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK, dropout=0.1, warmup_steps=2)
    data = TextDataModule(batch_size=BATCH, block_size=BLOCK, corpus_path=corpus, val_fraction=0.1)
    trainer.fit(model, data, ckpt_path=str(Path(folder, "last.ckpt")) if resume else None)
    return trainer


def interrupt_and_resume(kind: str, corpus: str, root: str, cases: list[dict], accumulate: int = 1) -> list[dict]:
    """On this rank: an uninterrupted run (synchronous saves), then each case interrupted by its signal and resumed
    from last.ckpt (a case with ``async``: its periodic saves in the background, one may be in flight at the stop)."""
    straight = local_weights(fit(kind, corpus, f"{root}/straight", [], False, accumulate).lightning_module)
    results = []
    for index, case in enumerate(cases):
        folder = f"{root}/case{index}"
        sender = SignalAt(case["step"], tuple(case["ranks"]), case["moment"], case["signum"])
        asynchronous = case.get("async", False)
        try:
            fit(kind, corpus, folder, [sender], False, accumulate, asynchronous)
            stopped = {"status": "finished"}
        except Preempted as stop:
            stopped = {"status": stop.code, "saved_step": saved_step(Path(folder, "last.ckpt"))}
        resumed = fit(kind, corpus, folder, [], True, accumulate, asynchronous)
        equal = all(
            torch.equal(weight, straight[name]) for name, weight in local_weights(resumed.lightning_module).items()
        )
        results.append({**stopped, "resumed_steps": resumed.global_step, "equal_to_straight": equal})
    return results


def seeded_cases(count: int, seed: int) -> list[dict]:
    """``count`` cases cycling through rank 0 only, rank 1 only and both, at seeded random steps and moments."""
    generator = random.Random(seed)
    targets = ([0], [1], [0, 1])
    cases = []
    for index in range(count):
        moment = MOMENTS[index % len(MOMENTS)] if index < len(MOMENTS) else generator.choice(MOMENTS)
        step = generator.randrange(1, MAX_STEPS - 3)
        if moment == "save":
            step += step % 2  # checkpoints are written at even steps
        signum = signal.SIGUSR1 if index == count - 1 else signal.SIGTERM
        asynchronous = index % 2 == 1  # every other case with async_checkpointing: a save in flight at the stop
        cases.append(
            {"ranks": targets[index % 3], "step": step, "moment": moment, "signum": signum, "async": asynchronous}
        )
    return cases


def check(cases: list[dict], ranks: list[list[dict]]) -> None:
    for case, rank0, rank1 in zip(cases, *ranks):
        expected = EXIT_STATUS_BASE + case["signum"]
        assert rank0["status"] == rank1["status"] == expected, (case, rank0, rank1)
        # The same step on both ranks, saved as last.ckpt, at most two optimizer steps after the signal.
        assert rank0["saved_step"] == rank1["saved_step"] and case["step"] < rank0["saved_step"] <= case["step"] + 2, (
            case
        )
        for rank in (rank0, rank1):
            assert rank["resumed_steps"] == MAX_STEPS and rank["equal_to_straight"], (case, rank)


@pytest.mark.slow
def test_ddp_ten_signals_at_random_points_stop_save_and_resume_exactly(tmp_path):
    corpus = str(write_corpus(tmp_path / "corpus.bin", train_batches_per_rank=8))
    cases = seeded_cases(10, seed=18)
    ranks = run_function(
        interrupt_and_resume, 2, args=("ddp", corpus, str(tmp_path), cases), init_process_group=False, timeout=400
    )
    check(cases, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepspeed"])  # FSDP's: the fault campaign's trials (test_fault_campaign.py)
def test_sharded_engines_stop_on_signals_save_and_resume_exactly(tmp_path, kind):
    corpus = str(write_corpus(tmp_path / "corpus.bin", train_batches_per_rank=8))
    cases = [
        {"ranks": [1], "step": 3, "moment": "backward", "signum": signal.SIGTERM},
        {"ranks": [0], "step": 4, "moment": "save", "signum": signal.SIGTERM, "async": True},
        {"ranks": [0, 1], "step": 5, "moment": "forward", "signum": signal.SIGUSR1, "async": True},
    ]
    ranks = run_function(
        interrupt_and_resume, 2, args=(kind, corpus, str(tmp_path), cases), init_process_group=False, timeout=300
    )
    check(cases, ranks)


@pytest.mark.slow
def test_under_gradient_accumulation_the_ranks_agree_within_the_step_and_stop_at_its_end(tmp_path):
    """Accumulation 4: a signal during the first micro-batch of an optimizer step is agreed two micro-batches later,
    so every rank stops at the end of that same step (not one step later, as a poll per step would), saves it whole,
    and the run resumed from it ends equal to an uninterrupted one."""
    corpus = str(write_corpus(tmp_path / "corpus.bin", train_batches_per_rank=8))
    cases = [
        {"ranks": [1], "step": 3, "moment": "forward", "signum": signal.SIGTERM},
        {"ranks": [0], "step": 5, "moment": "backward", "signum": signal.SIGUSR1},
    ]
    ranks = run_function(
        interrupt_and_resume, 2, args=("ddp", corpus, str(tmp_path), cases, 4), init_process_group=False, timeout=300
    )
    check(cases, ranks)
    assert [rank0["saved_step"] for rank0 in ranks[0]] == [case["step"] + 1 for case in cases]
