"""Stop on SIGTERM or SIGUSR1 as a job: every rank at the same step, the step saved, a non-zero exit status.

Lightning broadcasts from inside its signal handler (a deadlock when the other ranks are in an all-reduce) and before
every batch (a host sync per step), saves nothing and exits 0. Here, during ``fit``, the handler only records the
signal; before every batch the ranks agree without waiting, and at the next optimizer-step boundary (so the
checkpoint holds a whole step) each saves that step and exits with ``128 + signal``. Under SLURM, rank 0 then
requeues the job where SLURM would not (:mod:`.slurm_requeue`: SIGUSR1, and the SIGTERM of a preemption with a
grace time). Other stages keep the signal's default action.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fastdist.parallel.faults.stop_agreement import NO_REQUEST, StopAgreement, new_agreement_group
from lightning_fastdist.trainer.internals import InstancePatches, missing_internals_line
from lightning_fastdist.trainer.slurm_requeue import requeue, requeue_reason, slurm_job_id

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOPPED_NAME = "stopped"  # a stop save that cannot resume the job: a name neither `last` nor `hpc` finds
EXIT_STATUS_BASE = 128  # the shell's convention: a process ended by signal N reports 128 + N


class Preempted(SystemExit):
    """Raised on every rank after the interrupted step was saved; the process exits with ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(EXIT_STATUS_BASE + signum)
        self.signum = signum


class PreemptionHandler:
    """Coordinated stop of one trainer's ``fit`` on :data:`STOP_SIGNALS`.

    Args:
        trainer: :meth:`install` must run before Lightning registers its signal handlers (a ``setup`` hook does).
        timeout: how long a rank waits for the others' agreement before failing.
    """

    def __init__(self, trainer: Trainer, timeout: timedelta) -> None:
        self.trainer = trainer
        self.timeout = timeout
        self.agreement = StopAgreement(None)
        self._group: dist.ProcessGroup | None = None
        self._patches = InstancePatches()

    def install(self) -> None:
        """Replace Lightning's signal handling on this trainer; collective when fitting on several ranks.

        Optional: where this Lightning lacks an internal it patches, one line says so and Lightning's handling stays.
        """
        trainer = self.trainer
        missing = missing_internals_line(trainer, type(self).__name__)
        if missing is not None:
            rank_zero_warn(f"Preemption handling is off: {missing}.")
            return
        loop = trainer.fit_loop.epoch_loop
        self._patches.replace(trainer._signal_connector, "register_signal_handlers", self._register_handlers)
        # Lightning's per-batch broadcast of rank 0's flag (a host sync every batch) is replaced by our boundary check.
        self._patches.replace(loop, "_broadcast_sigterm_tensor", lambda: None)
        self._patches.replace(loop, "advance", self._check_then(loop.advance))
        if trainer.state.fn == TrainerFn.FITTING:
            self._group = new_agreement_group(self.timeout)
            self.agreement = StopAgreement(self._group)

    def uninstall(self) -> None:
        """Put Lightning's methods back and release the agreement group."""
        self.agreement.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        self._patches.undo()

    def _register_handlers(self) -> None:
        # Replaces _SignalConnector.register_signal_handlers, which Lightning calls right before running the stage.
        connector = self.trainer._signal_connector
        connector.received_sigterm = False
        connector._original_handlers = connector._get_current_signal_handlers()  # restored by Lightning's teardown
        if self.trainer.state.fn != TrainerFn.FITTING:
            return
        for signum in STOP_SIGNALS:
            connector._register_signal(signum, functools.partial(self._on_signal, signal.getsignal(signum)))

    def _on_signal(self, previous: Any, signum: int, frame: FrameType | None) -> None:
        # Host only: no collective, no device work (the other ranks may be inside one).
        self.agreement.request(signum)
        log.info(f"[rank {self.trainer.global_rank}] received {signal.Signals(signum).name}; stopping at the next step")
        if callable(previous):
            previous(signum, frame)  # a handler that was there before ours (as Lightning chains them)

    def _check_then(self, advance: Any) -> Any:
        def advance_after_check(data_fetcher: Any) -> None:
            # Polled before every batch, acted on before the first batch of an optimizer step: a request is agreed one
            # batch after the next (not one optimizer step), and the checkpoint still holds whole steps. With gradient
            # accumulation that halves the time from the signal to the save (the scheduler's grace time is short).
            signum = self.agreement.poll()
            progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
            if signum != NO_REQUEST and progress.ready % self.trainer.accumulate_grad_batches == 0:
                self._stop(signum)
            advance(data_fetcher)

        return advance_after_check

    def _stop(self, signum: int) -> None:
        trainer = self.trainer
        trainer._signal_connector.received_sigterm = True
        path = checkpoint_path_on_stop(trainer)
        trainer.save_checkpoint(path)
        name = signal.Signals(signum).name
        stopped = f"[rank {trainer.global_rank}] stopped by {name} after step {trainer.global_step}"
        status = EXIT_STATUS_BASE + signum
        if _wrote_no_checkpoint(trainer):
            log.warning(
                f"{stopped}: this node writes no checkpoint (another node writes the job's); exiting with status "
                f"{status} (started again with the same command it rejoins nodes still training; a whole job resumes "
                "with --ckpt_path last)."
            )
        elif not _stop_save_resumes(trainer):
            log.warning(
                f"{stopped}: saved the global weights as {path}, which cannot resume the job (its nodes stop each on "
                f"its own); exiting with status {status} (--ckpt_path last resumes from the last periodic checkpoint)."
            )
        else:
            log.warning(f"{stopped}: saved {path}; exiting with status {status} (resume with --ckpt_path last).")
        if trainer.is_global_zero:  # after save_checkpoint's barrier: every rank has saved
            requeue_slurm_job(trainer, signum)
        raise Preempted(signum)


def _wrote_no_checkpoint(trainer: Trainer) -> bool:
    """Whether this process's world is its node's alone (``outer_sync``, ``replica_groups``) and this node did not
    write the job's checkpoint: node 0 writes it under ``outer_sync``, the first node of the latest quorum under
    ``replica_groups`` (the strategy's ``across_nodes`` says whether it was this one)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() < trainer.world_size):
        return False
    across_nodes = getattr(trainer.strategy, "across_nodes", None)
    return not getattr(across_nodes, "wrote_last_checkpoint", trainer.node_rank == 0)


def _stop_save_resumes(trainer: Trainer) -> bool:
    """Whether what a stop saves can resume the job: not under ``outer_sync`` (the strategy's ``across_nodes``)."""
    return getattr(getattr(trainer.strategy, "across_nodes", None), "stop_save_resumes", True)


def checkpoint_path_on_stop(trainer: Trainer) -> str:
    """Where a stopped run saves: the ``ModelCheckpoint``'s ``last`` file, else Lightning's ``hpc_ckpt_N.ckpt`` (both
    what a requeued job resumes from). A stop save that cannot resume (``outer_sync``) goes to ``stopped.ckpt`` in
    the same folder instead: it never replaces the resumable state ``--ckpt_path last`` (or ``hpc``) finds."""
    callback = trainer.checkpoint_callback
    has_folder = isinstance(callback, ModelCheckpoint) and callback.dirpath is not None
    if not _stop_save_resumes(trainer):
        folder = callback.dirpath if has_folder else trainer.default_root_dir
        return os.path.join(folder, STOPPED_NAME + ModelCheckpoint.FILE_EXTENSION)
    if has_folder:
        names = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
        return callback.format_checkpoint_name(names, callback.CHECKPOINT_NAME_LAST)
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def requeue_slurm_job(trainer: Trainer, signum: int) -> None:
    """Under SLURM, ``scontrol requeue`` the job where SLURM would not requeue it by itself (:mod:`.slurm_requeue`):
    after SIGUSR1, and after the SIGTERM of a preemption with a grace time. Off with Lightning's
    ``SLURMEnvironment(auto_requeue=False)``."""
    environment = trainer._accelerator_connector.cluster_environment
    job = slurm_job_id()
    if not isinstance(environment, SLURMEnvironment) or job is None:
        return
    reason = requeue_reason(signum, environment.auto_requeue, job)
    if reason is not None:
        requeue(job, reason, trainer.global_rank)
