"""RayReport: hand Ray Train each checkpoint once it is complete, and resume from the one Ray restored.

Ray Train restarts a failed worker group from the last checkpoint passed to ``ray.train.report``; a checkpoint
reported before it is whole (a sharded folder one rank still writes, a background write) would be what a restart
loads. Our strategies publish every checkpoint at its path only once it is whole (``parallel/checkpoint/atomic.py``),
so "published" is "complete": rank 0 sees the path exist, every rank learns it in one broadcast, and all of them call
``ray.train.report`` together (Ray's report is a barrier: every worker calls it as often as the others). A
synchronous save is reported at the step that saved it; an asynchronous one at the first batch end after it is
published, and never later than the next save or the end of training. ``docs/ray.md`` has the flows.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

CHECKPOINT_NAME = "checkpoint.ckpt"  # inside each folder handed to Ray: RayReport.latest() points at it
_POLL_S = 0.05  # how often rank 0 looks for a background write's published checkpoint at the end of training


class RayReport(Callback):
    """Save a checkpoint every ``every_n_train_steps`` optimizer steps and hand it to Ray Train once complete, with the
    step, the epoch and the logged metrics; at the end of training the last step too. Run it inside a Ray Train
    worker (a ``TorchTrainer``'s ``train_func``) and resume with ``trainer.fit(..., ckpt_path=RayReport.latest())``.

    Args:
        every_n_train_steps: optimizer steps between two checkpoints (an integer >= 1).
        staging_dir: the folder each checkpoint is written to before Ray copies it to its storage. The workers of one
            machine share the default (the temporary folder); where the workers span several machines, give a folder
            every worker sees (the storage path's NFS, for one), since one worker hands Ray each checkpoint whole.
    """

    def __init__(self, every_n_train_steps: int, staging_dir: str | os.PathLike[str] | None = None) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise ValueError(f"RayReport: every_n_train_steps must be an integer >= 1, got {every_n_train_steps!r}.")
        self.every_n_train_steps = every_n_train_steps
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None
        self._folder: Path | None = None  # this fit's staging folder, the same on every rank
        self._pending: int | None = None  # the step of the checkpoint saved and not yet reported
        self._saved_step = 0  # the last step saved: accumulation's micro-batches save a step once
        self._staged = False  # whether this fit's folder holds a checkpoint (every rank alike)

    @staticmethod
    def latest() -> str | None:
        """The checkpoint Ray restored this worker group from (``ray.train.get_checkpoint()`` before this attempt
        reported any) as a local path for ``fit(ckpt_path=...)``, or ``None`` on a first start; the same on every
        worker. A checkpoint on remote storage is downloaded to a local folder first (once)."""
        return _restored_path()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        context = _ray_train_context()
        _restored_checkpoint()  # before this attempt reports: Ray's answer then names what it reported last
        hosts = [""] * trainer.world_size
        if dist.is_initialized():
            dist.all_gather_object(hosts, socket.gethostname())
        if self.staging_dir is None and len(set(hosts) - {""}) > 1:
            raise ValueError(
                f"RayReport: the workers run on {len(set(hosts))} machines; pass staging_dir= a folder all of them "
                "see (one worker hands Ray each checkpoint whole)."
            )
        root = self.staging_dir or Path(tempfile.gettempdir()) / "lightning_fastdist-ray"
        run = f"{ray_job_id()}-{context.get_experiment_name()}"
        if trainer.is_global_zero:  # what earlier attempts of this run staged (a worker lost cannot remove its own)
            for earlier in root.glob(f"{run}-*"):
                shutil.rmtree(earlier, ignore_errors=True)
        self._folder = root / trainer.strategy.broadcast(f"{run}-{uuid.uuid4().hex[:12]}")
        self._pending, self._staged = None, False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saved_step = trainer.global_step  # a fresh start's step 0, or the step the restored checkpoint holds

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._report_if_published(trainer, wait=False)
        step = trainer.global_step
        if step != self._saved_step and step % self.every_n_train_steps == 0:
            self._save(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self._saved_step:
            self._save(trainer)
        self._report_if_published(trainer, wait=True)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._remove_staged(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_staged(trainer)  # Lightning calls no teardown after an exception

    def _remove_staged(self, trainer: Trainer) -> None:
        if self._folder is not None and trainer.is_global_zero:
            shutil.rmtree(self._folder, ignore_errors=True)  # what Ray copied lives on in its storage
        self._folder = None

    def _save(self, trainer: Trainer) -> None:
        """Write this step's checkpoint where the last one was: that one is reported (and copied) by now."""
        self._report_if_published(trainer, wait=True)  # an earlier background write is handed over before
        assert self._folder is not None, "RayReport: setup did not run"
        path = self._folder / CHECKPOINT_NAME
        if trainer.is_global_zero:
            self._folder.mkdir(parents=True, exist_ok=True)
        if self._staged:  # the last one: its copy in Ray's storage is the one a restart reads
            trainer.strategy.remove_checkpoint(path)
        trainer.strategy.barrier("ray_report_staged")
        trainer.save_checkpoint(path)
        self._staged = True
        self._saved_step = self._pending = trainer.global_step
        self._report_if_published(trainer, wait=False)  # a synchronous save: published already

    def _report_if_published(self, trainer: Trainer, wait: bool) -> None:
        """Report the pending checkpoint once rank 0 sees it published (``wait``: wait for it to be); all ranks agree
        first, so that all of them call ``ray.train.report`` the same number of times."""
        if self._pending is None:
            return
        assert self._folder is not None
        path = self._folder / CHECKPOINT_NAME
        published = trainer.is_global_zero and _published(path, wait, trainer)
        if not trainer.strategy.broadcast(published):
            return
        step, self._pending = self._pending, None
        self._report(trainer, step)

    def _report(self, trainer: Trainer, step: int) -> None:
        import ray.train

        metrics = {name: float(value) for name, value in trainer.callback_metrics.items() if _is_scalar(value)}
        metrics.update(step=step, epoch=trainer.current_epoch)
        checkpoint = ray.train.Checkpoint.from_directory(str(self._folder)) if trainer.is_global_zero else None
        ray.train.report(metrics, checkpoint=checkpoint)  # every rank: Ray's barrier; rank 0's folder is the whole


@functools.cache
def _restored_checkpoint() -> Any:
    """What ``ray.train.get_checkpoint()`` answers before this process reports: the checkpoint Ray restarted the group
    from, handed to every worker alike. Afterwards Ray answers, on the reporting worker only, with the last checkpoint
    reported (the worker group is new processes after every restart, so this is one attempt's)."""
    _ray_train_context()  # one line outside a Ray Train worker
    import ray.train

    return ray.train.get_checkpoint()


@functools.cache
def _restored_path() -> str | None:
    checkpoint = _restored_checkpoint()
    if checkpoint is None:
        return None
    from pyarrow.fs import LocalFileSystem  # Ray's storage layer: pyarrow comes with ray[train]

    on_this_machine = isinstance(checkpoint.filesystem, LocalFileSystem)
    folder = checkpoint.path if on_this_machine else checkpoint.to_directory()
    return str(Path(folder) / CHECKPOINT_NAME)


def ray_job_id() -> str:
    """The Ray job's id: the same in every attempt of a run, another for another job."""
    import ray

    return ray.get_runtime_context().get_job_id()


def _published(path: Path, wait: bool, trainer: Trainer) -> bool:
    """Whether the checkpoint at ``path`` is published (``wait``: once it is, within the strategy's timeout)."""
    timeout = getattr(trainer.strategy, "timeout", None)
    deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 1800.0)
    while not path.exists():
        if not wait or time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) or isinstance(value, torch.Tensor) and value.numel() == 1


def _ray_train_context() -> Any:
    """Ray Train's context, or a one-line ``RuntimeError`` outside a Ray Train worker."""
    try:
        import ray.train

        return ray.train.get_context()
    except (ImportError, RuntimeError):
        raise RuntimeError(
            "RayReport: runs inside a Ray Train worker (the train_func of a ray.train.torch.TorchTrainer); "
            "install ray[train] (pip install lightning-fastdist[ray]) and fit there."
        ) from None
