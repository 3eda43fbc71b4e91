"""The fault campaign: seeded random faults at random points of real training runs, and what each did to the job.

A trial is a fault kind, a setup (an engine and a form: one world, or the nodes as torchft replica groups or under
outer_sync) and a step.
Each trial trains the tiny GPT on 2 CPU processes (gloo), injects its fault, and checks what a user would check:

- the job went on, or ended with one line (an exit status of a stop, a one-line error) and no traceback of ours;
- a resume (``ckpt_path="last"``) reaches the weights of the same run not interrupted, bit for bit, with the steps
  since the last complete save trained again (counted) and no checkpoint lost (``lost``: none to resume from, or an
  older one than the last complete save);
- no file the user owns changed (a notes file in the checkpoint folder, the recipe);
- no process of the job is left (its sessions are empty once the trial ends);
- nothing was served to, or run for, a stranger on the job's network.

Faults inside the training processes' reach run *in process*: the two ranks are forked once per engine and run many
trials each (a stop signal at any moment of a step, a full disk, a truncated or corrupted newest checkpoint, a read
error on one rank), since a trial there is a fit, not a launch. Faults that end or stop a process (a rank or node
SIGKILLed, a peer that hangs, a second job on the job's ports, a stranger's requests) run in processes of their own,
launched as torchrun would (``process_trials.py``). ``benchmarks/fault_campaign.py`` runs a campaign and writes its
JSON; ``tests/faults/test_fault_campaign.py`` runs a fixed seeded subset with one trial of each kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from tests.support.fault_runs import BATCH, BLOCK, write_corpus

MAX_STEPS = 8
SAVE_EVERY = 2
# The fault kinds of a campaign, each with the setups it applies to ("form" is the way nodes train together).
IN_PROCESS_KINDS = ("sigterm", "sigusr1", "full_disk", "corrupt_newest", "read_error")
PROCESS_KINDS = ("kill_rank", "kill_node", "hung_peer", "second_job", "stranger")
FAULT_KINDS = (*IN_PROCESS_KINDS, *PROCESS_KINDS)
ENGINES = ("ddp", "fsdp", "deepspeed")
USER_FILE = "notes.txt"  # a file of the user's in the checkpoint folder: no trial may change or remove it
USER_TEXT = "the user's own notes; never to be changed\n"
MOMENTS = ("forward", "backward", "optimizer_step", "save", "batch_end")


@dataclass(frozen=True)
class Trial:
    """One fault at one point of one setup's run."""

    number: int
    fault: str
    engine: str
    form: str
    step: int  # the optimizer step during or after which the fault lands
    ranks: tuple[int, ...] = (1,)  # the ranks (or, across nodes, the nodes) it hits
    moment: str = "batch_end"  # where in the step a signal lands
    seed: int = 0


@dataclass
class Outcome:
    """What a trial did: how the job ended and each check's result."""

    trial: Trial
    outcome: str  # "resumed" | "went_on" | "refused" | "failed"
    checks: dict[str, bool] = field(default_factory=dict)
    detail: str = ""

    def as_json(self) -> dict:
        return {**dataclasses.asdict(self.trial), "outcome": self.outcome, "checks": self.checks, "detail": self.detail}


def kinds_for(engine: str, form: str) -> tuple[str, ...]:
    """The fault kinds a setup takes: a read error on one rank needs files read by one rank only (FSDP's shards,
    DeepSpeed's partitions); a node lost and a stranger need nodes (a form across nodes)."""
    kinds = [kind for kind in FAULT_KINDS if kind not in ("kill_node", "stranger")] if form == "one_world" else []
    if form == "one_world" and engine == "ddp":
        kinds.remove("read_error")
    if form != "one_world":
        kinds = ["kill_node", "stranger"]
    return tuple(kinds)


SETUPS = (
    *[(engine, "one_world") for engine in ENGINES],
    ("ddp", "replica_groups"),
    ("ddp", "outer_sync"),
)


def plan(trials: int, seed: int) -> list[Trial]:
    """``trials`` seeded trials: the fault kinds in turn, so that any ``trials`` at least the number of kinds covers
    them all and each kind runs ``trials // len(FAULT_KINDS)`` times or more; each draws a setup that takes its kind,
    a step and where in it."""
    generator = random.Random(seed)
    planned = []
    for number in range(trials):
        kind = FAULT_KINDS[number % len(FAULT_KINDS)]
        engine, form = generator.choice([setup for setup in SETUPS if kind in kinds_for(*setup)])
        step = generator.randrange(1, MAX_STEPS - 2)
        moment = generator.choice(MOMENTS) if kind in ("sigterm", "sigusr1") else "batch_end"
        if moment == "save":
            step += step % SAVE_EVERY  # checkpoints are written at even steps
        ranks = generator.choice(((0,), (1,), (0, 1))) if kind in ("sigterm", "sigusr1") else (1,)
        planned.append(Trial(number, kind, engine, form, step, ranks, moment, generator.randrange(2**31)))
    return planned


# ---------------------------------------------------------------- what a trial looks at


def local_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every weight (a DTensor's local shard), as a copy."""
    return {
        name: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in module.state_dict().items()
    }


def digest(weights: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        hasher.update(name.encode())
        hasher.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:24]


def user_files_intact(folder: Path) -> bool:
    return (folder / USER_FILE).is_file() and (folder / USER_FILE).read_text() == USER_TEXT


# ---------------------------------------------------------------- in-process trials (run by both ranks)


class Fault(L.Callback):
    """An in-process trial's fault: a signal to the trial's ranks at its moment of its step, or the disk filled (the
    trial's folder is a small tmpfs) right before the save of its step."""

    def __init__(self, trial: Trial, filler: Path | None = None) -> None:
        self.trial, self.filler = trial, filler
        self.done = False

    def _land(self, trainer: L.Trainer, moment: str) -> None:
        trial = self.trial
        if self.done or moment != trial.moment or trainer.global_step != trial.step:
            return
        self.done = True
        if trial.fault in ("sigterm", "sigusr1") and trainer.global_rank in trial.ranks:
            os.kill(os.getpid(), signal.SIGTERM if trial.fault == "sigterm" else signal.SIGUSR1)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._land(trainer, "forward")
        if self.trial.moment == "backward" and trainer.global_step == self.trial.step:
            block = module.blocks[-1]  # its backward runs first: the rest of the backward is still to come

            def land_in_backward(*_) -> None:  # a full backward hook that returns something replaces the gradients
                self._land(trainer, "backward")
                handle.remove()

            handle = block.register_full_backward_hook(land_in_backward)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._land(trainer, "optimizer_step")

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self._land(trainer, "save")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.trial.fault == "full_disk" and trainer.global_step == self.trial.step and trainer.is_global_zero:
            fill_the_disk(self.filler)  # the save of this step (written after this hook) finds the disk full
        self._land(trainer, "batch_end")


def fill_the_disk(filler: Path) -> None:
    """Fill the file system holding ``filler`` but for a few kilobytes (what a log or another job would have left)."""
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # unbuffered: no flush fails at close
    try:
        while True:
            os.write(descriptor, b"\0" * (1 << 20))
    except OSError:
        pass
    finally:
        os.ftruncate(descriptor, max(0, os.fstat(descriptor).st_size - 16 * 1024))  # less than any checkpoint needs
        os.close(descriptor)


def make_strategy(engine: str) -> L.pytorch.strategies.Strategy:
    from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy  # noqa: PLC0415 - in the rank

    if engine == "deepspeed":
        from lightning_fastdist import FastDeepSpeedStrategy  # noqa: PLC0415 - deepspeed is an optional extra

        return FastDeepSpeedStrategy(stage=2, timeout=60)
    return FastDDPStrategy(timeout=60) if engine == "ddp" else FastFSDPStrategy(timeout=60)


def fit(engine: str, corpus: str, folder: Path, callbacks: list, resume: bool, max_steps: int = MAX_STEPS) -> L.Trainer:
    """The campaign's workload: tiny GPT with dropout, a checkpoint every 2 steps and ``last.ckpt`` in ``folder``."""
    from lightning_fastdist.demo import TextDataModule, TinyGPT  # noqa: PLC0415 - in the rank

    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_EVERY, save_last=True, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(engine), max_steps=max_steps, deterministic=True,
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[checkpoints, *callbacks],
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=BLOCK, dropout=0.1, warmup_steps=2)
    data = TextDataModule(batch_size=BATCH, block_size=BLOCK, corpus_path=corpus, val_fraction=0.1)
    trainer.fit(model, data, ckpt_path="last" if resume else None)
    return trainer


def damage_newest(folder: Path, step: int, rank_only: int | None) -> None:
    """Truncate every checkpoint of ``step`` in ``folder`` (``last.ckpt`` and ``...step=STEP.ckpt``; every file of a
    folder), or only the files rank ``rank_only`` alone reads (its shards, its partitions)."""
    for checkpoint in [folder / "last.ckpt", *folder.glob(f"*step={step}.ckpt")]:
        files = [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file())
        if rank_only is not None:
            files = [p for p in files if f"__{rank_only}_" in p.name or f"zero_pp_rank_{rank_only}_" in p.name]
        for path in files:
            path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 3)])


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def run_in_process_trials(engine: str, corpus: str, root: str, trials: list[Trial]) -> list[dict]:
    """On this rank (of 2): the uninterrupted run, then each trial's faulted run and its resume; what each showed."""
    rank = int(os.environ["RANK"])
    straight = digest(local_weights(fit(engine, corpus, Path(root, "straight"), [], False).lightning_module))
    results = []
    for trial in trials:
        folder = Path(root, f"trial{trial.number:04d}")
        small_disk = trial.fault == "full_disk"
        if rank == 0:
            folder.mkdir(parents=True)
            if small_disk:
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(folder)], check=True)
            (folder / USER_FILE).write_text(USER_TEXT)
        _barrier()
        try:
            results.append(_in_process_trial(trial, engine, corpus, folder, straight))
        finally:
            if rank == 0 and small_disk:
                subprocess.run(["umount", "--lazy", str(folder)], check=True)
    return results


def _in_process_trial(trial: Trial, engine: str, corpus: str, folder: Path, straight: str) -> dict:
    from lightning_fastdist.trainer.preemption import EXIT_STATUS_BASE, Preempted  # noqa: PLC0415 - in the rank

    rank = int(os.environ["RANK"])
    ended, line = "finished", ""
    try:
        if trial.fault in ("corrupt_newest", "read_error"):
            # a step a checkpoint was written at, after an older one: with none older, the one line is all there is
            saved = max(2 * SAVE_EVERY, trial.step + trial.step % SAVE_EVERY)
            fit(engine, corpus, folder, [], False, max_steps=saved)
            if rank == 0:
                damage_newest(folder, saved, 1 if trial.fault == "read_error" else None)
            ended = "damaged"
        else:
            fit(engine, corpus, folder, [Fault(trial, folder / "filler.bin")], False)
    except Preempted as stopped:
        ended, line = f"exit {stopped.code}", "preempted"
    except Exception as error:  # noqa: BLE001 - what a user would read: must be one line of ours
        ended, line = type(error).__name__, str(error)
    if rank == 0 and (folder / "filler.bin").exists():
        (folder / "filler.bin").unlink()  # the user frees the space, then resumes
    _barrier()
    try:
        resumed = fit(engine, corpus, folder, [], True)
        resumed_steps, equal = resumed.global_step, digest(local_weights(resumed.lightning_module)) == straight
    except Exception as error:  # noqa: BLE001 - a resume that fails is a lost trial, not the end of the campaign
        resumed_steps, equal, line = -1, False, f"{line} | the resume failed: {type(error).__name__}: {error}"
    expected_end = {
        "sigterm": f"exit {EXIT_STATUS_BASE + signal.SIGTERM}",
        "sigusr1": f"exit {EXIT_STATUS_BASE + signal.SIGUSR1}",
        "full_disk": "CheckpointSaveError",
        "corrupt_newest": "damaged",
        "read_error": "damaged",
    }[trial.fault]
    return {
        "number": trial.number,
        "ended": ended,
        "one_line": ended == expected_end and "\n" not in line,
        "resumed_steps": resumed_steps,
        "equal": equal,
        "user_files": user_files_intact(folder),
        "line": line[:600],
    }


def in_process_outcomes(trials: list[Trial], per_rank: list[list[dict]]) -> list[Outcome]:
    """Each in-process trial's outcome from both ranks' records."""
    outcomes = []
    for trial, rank0, rank1 in zip(trials, *per_rank, strict=True):
        checks = {
            "ends_in_one_line": rank0["one_line"] and rank1["one_line"],
            "consistent": rank0["equal"] and rank1["equal"],
            "not_lost": rank0["resumed_steps"] == rank1["resumed_steps"] == MAX_STEPS,
            "user_files_unchanged": rank0["user_files"],
        }
        detail = "" if all(checks.values()) else f"{rank0} | {rank1}"
        outcomes.append(Outcome(trial, "resumed", checks, detail))
    return outcomes


def prepare_corpus(root: Path) -> str:
    return str(write_corpus(root / "corpus.bin", train_batches_per_rank=8))
