"""FaultTolerance: what every strategy of this package does when a job is stopped, mixed up, or fed bad state.

- **Job identity.** The process group is joined through
  :func:`~lightning_fastdist.parallel.faults.job_identity.join_process_group`: ranks of
  another launch on the same port are refused, a port in use is named as such.
  When Lightning starts the processes itself on one node, the launch gets a fresh run id
  (:meth:`FaultTolerance.launch_identity`, in the environment of the launch only).
- **Preemption.** SIGTERM / SIGUSR1 on any subset of ranks stop every rank at the
  same optimizer step, with that step saved and exit status ``128 + signal``
  (:class:`~lightning_fastdist.trainer.preemption.PreemptionHandler`).
- **A lost peer** is named in one line
  (:func:`~lightning_fastdist.parallel.faults.collective_timeout.explain_lost_peer`).
- **No non-finite checkpoint.** A save whose weights or optimizer state hold NaN
  or inf (on any rank) is refused before anything is written, so the previous
  checkpoints stay as they were and a restart never resumes garbage.
- **Unusable checkpoints** (truncated, a missing shard, not a checkpoint at all)
  end in one line naming the file
  (:func:`~lightning_fastdist.parallel.checkpoint.problems.describe_unloadable`);
  a ``last*.ckpt`` checkpoint (what ``ckpt_path="last"`` finds) that does not
  load is replaced by the newest checkpoint of the same folder that does, with a
  warning saying so.

A strategy lists this mixin first among its bases, launches inside :meth:`launch_identity`
(:class:`~lightning_fastdist.strategies.shared_setup.SharedSetup` does), calls
:meth:`start_fault_handling` at the start of its ``setup``, and routes its
``save_checkpoint`` / ``load_checkpoint`` through :meth:`refuse_non_finite` and
:meth:`load_or_fall_back`; ``timeout`` is its collective timeout.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError, describe_unloadable
from lightning_fastdist.parallel.faults.collective_timeout import explain_lost_peer
from lightning_fastdist.parallel.faults.finite_state import non_finite_entry
from lightning_fastdist.parallel.faults.job_identity import OWN_RUN_ID_VARIABLE, join_process_group, new_run_id
from lightning_fastdist.trainer.preemption import PreemptionHandler

CHECKPOINT_SUFFIX = ModelCheckpoint.FILE_EXTENSION
TRAINING_STATE_KEYS = ("state_dict", "optimizer_states")  # the checkpoint entries that must be finite
# What a failed load can raise: torch.distributed.checkpoint's error is a BaseException.
_LOAD_ERRORS = (Exception, CheckpointException)


class NonFiniteCheckpointError(RuntimeError):
    """A checkpoint was refused because the state to be saved holds NaN or inf."""


class FaultTolerance:
    """Mixin for a Lightning strategy: job identity, preemption, lost peers, finite and loadable checkpoints."""

    timeout: timedelta
    handles_preemption = True  # read by SyncFreeLogging, which otherwise installs the same handler itself
    _preemption: PreemptionHandler | None = None

    @contextmanager
    def launch_identity(self) -> Generator[None, None, None]:
        """Around Lightning's launch: the processes it starts inherit a fresh run id; the variable is then put
        back as it was (a library leaves its user's environment as it found it).

        Only where this launcher starts every rank of the job (one node): under a multi-node launch by
        hand each node's launcher would draw its own id, and the nodes would refuse each other.
        """
        environment = self.cluster_environment  # type: ignore[attr-defined]
        if environment.creates_processes_externally or self.num_nodes > 1:  # type: ignore[attr-defined]
            yield
            return
        before = os.environ.get(OWN_RUN_ID_VARIABLE)
        os.environ[OWN_RUN_ID_VARIABLE] = new_run_id()
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(OWN_RUN_ID_VARIABLE, None)
            else:
                os.environ[OWN_RUN_ID_VARIABLE] = before

    def _join_process_group(self) -> None:
        if dist.is_initialized():
            return
        self.accelerator.setup_device(self.root_device)  # type: ignore[attr-defined]
        self.set_world_ranks()  # type: ignore[attr-defined]
        backend = self._get_process_group_backend()  # type: ignore[attr-defined]
        environment = self.cluster_environment  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        root = self.root_device  # type: ignore[attr-defined]
        join_process_group(
            backend,
            self.global_rank,
            self.world_size,
            self.timeout,
            root if root.type != "cpu" else None,  # type: ignore[attr-defined]
        )
        if backend == "nccl":
            atexit.register(_destroy_dist_connection)  # as Lightning does: no warning about a live group at exit

    def setup_distributed(self) -> None:  # DDPStrategy's name for it
        self._join_process_group()
        super().setup_distributed()  # type: ignore[misc]  # finds the group initialised and keeps it

    def _setup_distributed(self) -> None:  # ModelParallelStrategy's name for it
        self._join_process_group()
        super()._setup_distributed()  # type: ignore[misc]

    def start_fault_handling(self, trainer: Any) -> None:
        """Install the preemption handler on ``trainer``; call first in ``setup`` (collective when fitting)."""
        self._preemption = PreemptionHandler(trainer, self.timeout)
        self._preemption.install()

    def teardown(self) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        super().teardown()  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        explain_lost_peer(exception, self.timeout, self.global_rank, backend)  # type: ignore[attr-defined]
        super().on_exception(exception)  # type: ignore[misc]

    def refuse_non_finite(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Collective: raise :class:`NonFiniteCheckpointError` on every rank if any rank's state holds NaN/inf.

        Call on every rank before anything is written; a DTensor is tested by its own rank's shard. Only the
        weights and the optimizer state are tested: callbacks keep infinities on purpose (a best score so far).
        """
        entry = non_finite_entry({key: checkpoint[key] for key in TRAINING_STATE_KEYS if key in checkpoint})
        if not self.reduce_boolean_decision(entry is not None, all=False):  # type: ignore[attr-defined]
            return
        raise NonFiniteCheckpointError(
            f"refusing to save '{filepath}' at step {checkpoint.get('global_step', '?')}: "
            f"{entry or 'the state of another rank'} holds NaN or inf. The checkpoints saved before are kept; "
            "resume from them, and add NonFiniteLoss(action='skip') to skip steps whose loss is not finite."
        )

    def load_or_fall_back(self, path: Any, load: Callable[[Any], dict[str, Any]], expects_folder: bool | None) -> dict:
        """``load(path)``; if it fails, one line naming the file, or for a ``last`` checkpoint the newest that loads.

        Args:
            path: the checkpoint Lightning resolved (``ckpt_path``, ``"last"`` already resolved to a file).
            load: loads one path on every rank (a collective for sharded checkpoints).
            expects_folder: passed to :func:`describe_unloadable`.

        Raises:
            UnusableCheckpointError: neither ``path`` nor (for ``last``) any other checkpoint of its folder loads.
        """
        try:
            return load(path)
        except _LOAD_ERRORS as error:
            problem = describe_unloadable(path, error, expects_folder)
        if not is_last_checkpoint(Path(path)):
            raise UnusableCheckpointError(problem) from None
        for candidate in _older_checkpoints(Path(path)):
            try:
                checkpoint = load(candidate)
            except _LOAD_ERRORS:
                continue
            rank_zero_warn(f"{problem} Resuming from '{candidate}' instead, the newest checkpoint there that loads.")
            self.lightning_module.trainer._checkpoint_connector._ckpt_path = str(candidate)  # type: ignore[attr-defined]
            return checkpoint
        raise UnusableCheckpointError(f"{problem} No other checkpoint in '{Path(path).parent}' loads either.") from None


def is_last_checkpoint(path: Path) -> bool:
    """Whether ``path`` is named like ``ModelCheckpoint``'s ``last`` checkpoints (what ``ckpt_path="last"`` finds)."""
    return path.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) and path.suffix == CHECKPOINT_SUFFIX


def _older_checkpoints(failed: Path) -> list[Path]:
    """The other checkpoints (files or sharded folders) in ``failed``'s folder, newest first."""
    # A save in progress ("last.ckpt.partial") has another suffix and is never a candidate.
    others = [entry for entry in failed.parent.iterdir() if entry.suffix == CHECKPOINT_SUFFIX and entry != failed]
    return sorted(others, key=lambda entry: entry.stat().st_mtime, reverse=True)
