"""Training functions for Ray Train's workers (``TorchTrainer(train_func)``), as Ray's guide writes them, and what they
leave for the tests and ``benchmarks/ray_flows.py`` to read.

A ``train_func`` runs in Ray's worker processes, which import this module by name (the driver puts the repository on
their ``PYTHONPATH``). What a run leaves is on the disk of this one machine, in a folder per fit, written as it goes
(one line per step and per start), so that a worker killed mid-run has left everything up to its last step:
``steps-rank<R>.jsonl``, ``starts-rank<R>.jsonl``, ``lost.json``, and each fit's final weights and what Lightning
made of the job (``result-rank<R>.pt``).
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.support.workloads import BLOCK_SIZE, tiny_gpt

STEPS = 8  # two epochs of each rank's half of SAMPLES, the second shuffled otherwise than the first
SAMPLES, BATCH_SIZE = 32, 4
ENGINES = ("ray_ddp", "fast_ddp", "fast_fsdp", "fast_deepspeed")


def strategy(engine: str) -> Any:
    """The strategy as a user writes it inside ``train_func``."""
    import lightning_fastdist as lf

    if engine == "ray_ddp":
        from ray.train.lightning import RayDDPStrategy

        return RayDDPStrategy()
    if engine == "fast_ddp":
        return lf.FastDDPStrategy()
    if engine == "fast_fsdp":  # its checkpoints written in the background: RayReport hands each over once published
        return lf.FastFSDPStrategy(sharding="zero3", async_checkpointing=True)
    if engine == "fast_deepspeed":
        return lf.FastDeepSpeedStrategy(stage=2)
    raise ValueError(engine)


def shuffled_windows(resumable: bool = False) -> DataLoader:
    """Seeded distinct ``(input, target)`` windows, shuffled: Lightning gives each rank a shuffled half per epoch
    (``resumable``: through ResumableDataLoader, whose position a resume at another world size continues from)."""
    from lightning_fastdist.data import ResumableDataLoader

    windows = torch.randint(0, 256, (SAMPLES, BLOCK_SIZE + 1), generator=torch.Generator().manual_seed(1))
    loader = ResumableDataLoader if resumable else DataLoader
    return loader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=BATCH_SIZE, shuffle=True)


def sample_ids(inputs: torch.Tensor) -> list[int]:
    """Which of :func:`shuffled_windows`' samples a batch holds (their indices)."""
    windows = shuffled_windows().dataset.tensors[0]
    return [int((windows == row).all(dim=1).nonzero()[0]) for row in inputs]


class StepLog(L.Callback):
    """One JSON line per training batch: the attempt, the global step after it, the time, the samples and the loss."""

    def __init__(self, path: Path, attempt: int) -> None:
        self.path, self.attempt = path, attempt

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        line = {
            "attempt": self.attempt,
            "step": trainer.global_step,
            "time": time.time(),
            "samples": sample_ids(batch[0]),
            "loss": float(outputs["loss"]),
        }
        with self.path.open("a") as log:
            log.write(json.dumps(line) + "\n")


class LoseThisWorkerAt(L.Callback):
    """At the end of optimizer step ``step``, before anything else of that step's end, lose this worker: ``"kill"``
    SIGKILLs the process (a worker lost without warning); ``"hold"`` waits until its Ray node is taken away (the test
    removes the node once ``record`` exists). ``record`` gets the step and the time first.

    Ray registers a reported checkpoint when its controller next polls the workers (every 2 s); a worker lost before
    that poll resumes from the one before. To make the resumed step the test's to predict, this first waits until
    Ray has registered every report so far (``ray.train.get_all_reported_checkpoints``); the loss stays abrupt."""

    def __init__(self, step: int, how: str, record: Path) -> None:
        self.step, self.how, self.record = step, how, record

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        import ray.train

        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        self.record.write_text(json.dumps({"step": self.step, "time": time.time()}))
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # until the node goes, and this process with it
            time.sleep(0.05)


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, on every rank (an FSDP2 shard gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
        for name, value in module.state_dict().items()
    }


def fit_once(
    engine: str, out: Path, report_every: int | None = None, lose: dict | None = None, resumable: bool = False
) -> None:
    """One fit of ``STEPS`` steps of ``engine``, as Ray's guide writes it, logging into ``out``; with ``report_every``
    through :class:`~lightning_fastdist.RayReport` and, if this fit was interrupted, resumed from the checkpoint Ray
    restored (a run's one latest checkpoint: another fit's where this one was not lost). ``lose``: in the first
    attempt, the worker of rank ``lose["rank"]`` (or the one on the node at address ``lose["node"]``) is lost at step
    ``lose["step"]`` as ``lose["how"]`` says (:class:`LoseThisWorkerAt`); ``resumable``: the data through
    ResumableDataLoader."""
    import ray.train
    import ray.util
    from ray.train.lightning import RayLightningEnvironment, prepare_trainer

    from lightning_fastdist import RayReport

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    out.mkdir(parents=True, exist_ok=True)
    starts = out / f"starts-rank{rank}.jsonl"
    attempt = len(starts.read_text().splitlines()) if starts.exists() else 0
    ckpt_path = RayReport.latest() if report_every and attempt > 0 else None  # Ray's one latest: this fit's if lost
    with starts.open("a") as log:
        line = {"attempt": attempt, "time": time.time(), "ckpt_path": ckpt_path, "world_size": world_size}
        log.write(json.dumps(line) + "\n")
    callbacks: list[L.Callback] = []
    if lose is not None and attempt == 0 and rank == lose.get("rank", rank):
        if lose.get("node", ray.util.get_node_ip_address()) == ray.util.get_node_ip_address():
            callbacks.append(LoseThisWorkerAt(lose["step"], lose["how"], out / "lost.json"))
    callbacks.append(StepLog(out / f"steps-rank{rank}.jsonl", attempt))
    if report_every:
        callbacks.append(RayReport(every_n_train_steps=report_every))
    trainer = L.Trainer(
        strategy=strategy(engine),
        plugins=[] if engine == "fast_deepspeed" else [RayLightningEnvironment()],  # ours put it in when left out
        callbacks=callbacks,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt(), shuffled_windows(resumable), ckpt_path=ckpt_path)
    result = {
        "weights": full_weights(trainer.lightning_module),
        "global_step": trainer.global_step,
        "lightning_job": (trainer.num_nodes, trainer.num_devices, trainer.world_size, trainer.global_rank),
        "device": str(trainer.strategy.root_device),
        "warnings": [str(warning.message) for warning in warned],
    }
    torch.save(result, out / f"result-rank{rank}.pt")


def fitted(out: Path, world_size: int) -> bool:
    """Whether every rank finished a fit logging into ``out`` (a restarted ``train_func`` does not fit it again)."""
    return all((out / f"result-rank{rank}.pt").exists() for rank in range(world_size))


# The packaged script's command at a tiny size: the cpu_smoke recipe, 3 steps, one validation; reports at step 2 and
# at the end of training.
SCRIPT_STEPS, SCRIPT_REPORT_EVERY = 3, 2
SCRIPT_COMMAND = [
    "fit", "--config", "cpu_smoke", "--trainer.max_steps", str(SCRIPT_STEPS),
    "--trainer.val_check_interval", str(SCRIPT_STEPS), "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
    "--model.block_size", "32", "--data.block_size", "32", "--data.batch_size", "4",
]  # fmt: skip


def run_packaged_script(folder: Path, rank: int) -> None:
    """What each worker of ``python -m lightning_fastdist.cli.ray_train ... fit`` runs (its ``train_func``), started
    in ``folder``; then ``done-rank<R>``."""
    from lightning_fastdist.cli.ray_train import train_func

    folder.mkdir(parents=True, exist_ok=True)
    train_func({"command": SCRIPT_COMMAND, "report_every": SCRIPT_REPORT_EVERY, "folder": str(folder)})
    (folder / f"done-rank{rank}").touch()


def train_engines_then_lose_workers(config: dict) -> None:
    """``train_func`` of the job ``tests/ray`` reads (``FailureConfig(max_failures=2)``, 1 to 2 workers):

    1. one uninterrupted fit per engine of ``ENGINES``, each logging into ``<out>/<engine>``, ours through RayReport
       every ``config["engines_report_every"]`` steps;
    2. the packaged Ray script's worker part, in ``<out>/script`` (:func:`run_packaged_script`);
    3. FastDDPStrategy through RayReport into ``<out>/killed``, rank 1 SIGKILLed at step ``config["kill_step"]`` of
       its first attempt: Ray restarts the two workers, which resume;
    4. the same into ``<out>/node_removed`` through ResumableDataLoader, the worker on the second Ray node holding at
       step ``config["removal_step"]`` until the test removes that node: Ray restarts one worker (elastic sizing),
       which resumes at the smaller world.

    A restarted ``train_func`` does not fit again what every rank finished."""
    import ray.train

    out, world_size = Path(config["out"]), ray.train.get_context().get_world_size()
    for engine in ENGINES:
        if not fitted(out / engine, world_size):
            fit_once(engine, out / engine, config["engines_report_every"] if engine != "ray_ddp" else None)
    rank = ray.train.get_context().get_world_rank()
    if not all((out / "script" / f"done-rank{each}").exists() for each in range(world_size)):
        run_packaged_script(out / "script", rank)
    report_every = config["report_every"]
    if not fitted(out / "killed", world_size):
        fit_once("fast_ddp", out / "killed", report_every, {"rank": 1, "step": config["kill_step"], "how": "kill"})
    lose = {"node": config["second_node"], "step": config["removal_step"], "how": "hold"}
    fit_once("fast_ddp", out / "node_removed", report_every, lose, resumable=True)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
