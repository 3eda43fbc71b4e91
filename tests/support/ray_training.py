"""Training functions for Ray Train's workers (``TorchTrainer(train_func)``), as Ray's guide writes them, and what they
leave for the tests and ``benchmarks/ray_flows.py`` to read.

A ``train_func`` runs in Ray's worker processes, which import this module by name (the driver puts the repository on
their ``PYTHONPATH``). What a run leaves is on the disk of this one machine, written as it goes (one line per step
and per start), so that a worker killed mid-run has left everything up to its last step: ``steps-rank<R>.jsonl``,
``starts-rank<R>.jsonl``, ``killed.json``, and each fit's final weights and losses (``result-<engine>-rank<R>.pt``).
"""

from __future__ import annotations

import json
import os
import signal
import time
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
    if engine == "fast_fsdp":
        return lf.FastFSDPStrategy(sharding="zero3")
    if engine == "fast_deepspeed":
        return lf.FastDeepSpeedStrategy(stage=2)
    raise ValueError(engine)


def shuffled_windows() -> DataLoader:
    """Seeded distinct ``(input, target)`` windows, shuffled: Lightning gives each rank a shuffled half per epoch."""
    windows = torch.randint(0, 256, (SAMPLES, BLOCK_SIZE + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=BATCH_SIZE, shuffle=True)


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


class KillAt(L.Callback):
    """SIGKILL this process at the end of optimizer step ``step`` (a worker lost without warning), before anything
    else of that step's end: the time goes to ``killed.json`` first.

    Ray registers a reported checkpoint when its controller next polls the workers (every 2 s); a worker lost before
    that poll resumes from the one before. To make the resumed step the test's to predict, this first waits until
    Ray has registered every report so far (``ray.train.get_all_reported_checkpoints``); the kill stays abrupt."""

    def __init__(self, step: int, record: Path) -> None:
        self.step, self.record = step, record

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            import ray.train

            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
            self.record.write_text(json.dumps({"step": self.step, "time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, on every rank (an FSDP2 shard gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
        for name, value in module.state_dict().items()
    }


def fit_once(engine: str, out: Path, report_every: int | None = None, kill: dict | None = None) -> None:
    """One fit of ``STEPS`` steps of ``engine``, as Ray's guide writes it, logging into ``out``; with ``report_every``
    through :class:`~lightning_fastdist.RayReport` and resumed from the checkpoint Ray restored; ``kill``
    (``{"rank": R, "step": S}``) kills rank R at step S of the first attempt."""
    import ray.train
    from ray.train.lightning import RayLightningEnvironment, prepare_trainer

    from lightning_fastdist import RayReport

    rank = ray.train.get_context().get_world_rank()
    out.mkdir(parents=True, exist_ok=True)
    starts = out / f"starts-rank{rank}.jsonl"
    attempt = len(starts.read_text().splitlines()) if starts.exists() else 0
    ckpt_path = RayReport.latest() if report_every else None
    with starts.open("a") as log:
        log.write(json.dumps({"attempt": attempt, "time": time.time(), "ckpt_path": ckpt_path}) + "\n")
    callbacks: list[L.Callback] = []
    if kill is not None and kill["rank"] == rank and attempt == 0:
        callbacks.append(KillAt(kill["step"], out / "killed.json"))
    callbacks.append(StepLog(out / f"steps-rank{rank}.jsonl", attempt))
    if report_every:
        callbacks.append(RayReport(every_n_train_steps=report_every))
    trainer = L.Trainer(
        strategy=strategy(engine),
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(tiny_gpt(), shuffled_windows(), ckpt_path=ckpt_path)
    result = {
        "weights": full_weights(trainer.lightning_module),
        "global_step": trainer.global_step,
        "lightning_job": (trainer.num_nodes, trainer.num_devices, trainer.world_size, trainer.global_rank),
        "device": str(trainer.strategy.root_device),
    }
    torch.save(result, out / f"result-rank{rank}.pt")


def fitted(out: Path, world_size: int) -> bool:
    """Whether every rank finished a fit logging into ``out`` (a restarted ``train_func`` does not fit it again)."""
    return all((out / f"result-rank{rank}.pt").exists() for rank in range(world_size))


def train_engines_then_killed(config: dict) -> None:
    """``train_func``: one uninterrupted fit per engine of ``ENGINES`` (each logging into ``<out>/<engine>``), then
    FastDDPStrategy through RayReport every ``config["report_every"]`` steps (into ``<out>/killed``), rank
    ``config["kill"]["rank"]`` killed at step ``config["kill"]["step"]`` of its first attempt. Ray restarts the group
    (``FailureConfig(max_failures=1)``): the fits done are not repeated, the killed one resumes from the checkpoint
    Ray restored."""
    import ray.train

    out, world_size = Path(config["out"]), ray.train.get_context().get_world_size()
    for engine in ENGINES:
        if not fitted(out / engine, world_size):
            fit_once(engine, out / engine)
    fit_once("fast_ddp", out / "killed", config["report_every"], config["kill"])


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
