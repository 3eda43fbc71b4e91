"""The ``multi_node`` recipe shrunk for the SLURM tests, and what its runs record.

The tests submit the packaged ``train.sbatch`` with :func:`cpu_sbatch_options` before the script's name and
:func:`tiny_overrides` after it (what a user of a CPU cluster writes, documented in the script), plus
:class:`SampleLog` appended to the recipe's callbacks. Every run of the job (the first and each requeued one) then
writes, per rank, one JSON line per trained batch to ``<folder>/rank<R>.run<N>.jsonl`` (``N`` is
``SLURM_RESTART_COUNT``): the sample indices trained, the step they were trained at and the weights' digest after
it, from which a test counts samples trained twice or skipped across requeues and compares weights bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import Dataset

from lightning_fastdist.parallel.fsdp.local_shards import local_part

#: Tiny TinyGPT steps: a 1-layer 32-wide model on 16-byte windows, 2 per rank and step, no accumulation, no compile,
#: no validation, a checkpoint every 2 steps; the recipe's strategy (PowerSGD DDP), precision and callbacks stay.
BATCH, BLOCK = 2, 16


def cpu_sbatch_options(nodes: int = 2, tasks_per_node: int = 1) -> list[str]:
    """The sbatch options that fit the script's GPU allocation onto the test cluster's CPU nodes (none of them a
    GPU), with room for the time limit: as ``docs/slurm.md`` tells a user of a cluster without GPUs."""
    return [
        "--gpus-per-node=0",
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks_per_node}",
        "--cpus-per-task=1",
        "--time=10",
    ]


def tiny_overrides(
    max_steps: int,
    log_folder: Path,
    slow_from: int | None = None,
    seconds: float = 0.0,
    hold_at: int | None = None,
    release: Path | None = None,
) -> list[str]:
    """``lightning-fastdist fit`` arguments after the script's name: the recipe at a test's size, with
    :class:`SampleLog` writing into ``log_folder`` (steps from ``slow_from`` on take ``seconds`` longer, so that a
    signal sent then finds the run still training; every rank holds after step ``hold_at`` until ``release`` exists,
    so that a fault lands at a known step however loaded the machine)."""
    args = [
        "--trainer.accelerator", "cpu", "--trainer.max_steps", str(max_steps),
        "--trainer.strategy.init_args.compile", "false", "--trainer.strategy.init_args.timeout", "30",
        "--trainer.accumulate_grad_batches", "1",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2", "--model.block_size", str(BLOCK),
        "--model.warmup_steps", "2",
        "--data.batch_size", str(BATCH), "--data.block_size", str(BLOCK), "--data.num_workers", "0",
        # The recipe's last callback is its ModelCheckpoint: these set its interval, then append SampleLog.
        "--trainer.callbacks.every_n_train_steps", "2",
        "--trainer.callbacks+", "tests.support.slurm_workload.SampleLog",
        "--trainer.callbacks.folder", str(log_folder),
    ]  # fmt: skip
    if slow_from is not None:
        args += ["--trainer.callbacks.slow_from", str(slow_from), "--trainer.callbacks.seconds", str(seconds)]
    if hold_at is not None:
        args += ["--trainer.callbacks.hold_at", str(hold_at), "--trainer.callbacks.release", str(release)]
    return args


HOLD_LIMIT_S = 300  # a test that never releases still ends (its own timeout is shorter)


class _Served(Dataset):
    """The training set, remembering each index it serves, in order (the loader reads in this process)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.served: deque[int] = deque()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        self.served.append(int(index))
        return self.dataset[index]


def digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """A digest of a module's state (or a checkpoint's ``state_dict``): equal only if every tensor is bitwise equal."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(state_dict.items()):
        hasher.update(name.encode())
        hasher.update(local_part(tensor.detach()).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:32]


class SampleLog(L.Callback):
    """One JSON line per trained batch, per rank and run: ``{"step", "epoch", "samples", "digest", "time"}``; at the
    end of training ``{"final_step", "digest"}``.

    ``samples`` are the dataset indices of the batch trained at optimizer step ``step``, ``digest`` the weights'
    (:func:`digest`) after it (the optimizer steps on every batch here). The loader fetches a batch
    ahead of the one training, so the log takes each batch's indices from the front of what the dataset served: a
    batch fetched but never trained (the run stopped first) is never logged. Needs ``num_workers: 0``.

    ``slow_from``/``seconds``: from that step on, each step sleeps that long, so that a test's signal, sent once
    the log shows the step, arrives while the run is still training however loaded the machine.
    ``hold_at``/``release``: after that step is logged, the rank waits until the file ``release`` exists (at most
    ``HOLD_LIMIT_S``): a test lands its fault (a lost node) while every rank is at that step, then releases them.
    """

    def __init__(
        self,
        folder: str,
        slow_from: int | None = None,
        seconds: float = 0.0,
        hold_at: int | None = None,
        release: str | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.slow_from, self.seconds = slow_from, seconds
        self.hold_at, self.release = hold_at, Path(release) if release else None
        self._served: _Served | None = None
        self._file = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning runs the datamodule's setup before the callbacks': its training set exists, no loader yet.
        datamodule = trainer.datamodule
        if stage != "fit" or datamodule is None or datamodule.hparams.get("num_workers", 0) != 0:
            raise ValueError("SampleLog records the training samples of `fit` with data.num_workers 0")
        datamodule.train_set = self._served = _Served(datamodule.train_set)
        self.folder.mkdir(parents=True, exist_ok=True)
        run = os.environ.get("SLURM_RESTART_COUNT", "0")
        self._file = open(self.folder / f"rank{trainer.global_rank}.run{run}.jsonl", "a", buffering=1)  # noqa: SIM115

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        samples = [self._served.served.popleft() for _ in range(len(batch[0]))]
        line = {
            "step": trainer.global_step, "epoch": trainer.current_epoch, "samples": samples,
            "digest": digest(pl_module.state_dict()), "time": time.time(),
        }  # fmt: skip
        self._file.write(json.dumps(line) + "\n")
        if self.slow_from is not None and trainer.global_step >= self.slow_from:
            time.sleep(self.seconds)
        if trainer.global_step == self.hold_at and self.release is not None:
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not self.release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        final = {"final_step": trainer.global_step, "digest": digest(pl_module.state_dict())}
        self._file.write(json.dumps(final) + "\n")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
