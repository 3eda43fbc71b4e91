"""SIGTERM handling for multi-process training without a collective before every batch.

Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training batch (a
collective plus a ``.item()``: one host sync per step), and its signal handler
broadcasts once more from inside the handler. :class:`CoordinatedSigterm`
replaces both on one trainer:

- the signal handler only records the signal on the host (and, like
  Lightning's, forwards it to the processes the launcher started);
- every ``check_every_n_batches`` training batches, and at the end of each
  training epoch, all ranks all-reduce (max) their flags: one collective and
  one host read. If any rank was signalled, every rank sets
  ``trainer.received_sigterm`` and raises ``SIGTERMException`` before the same
  batch, so no rank waits in a collective for a rank that already left.

A signal that arrives outside the training batches (validation, testing)
sets ``trainer.received_sigterm`` at once, as Lightning does; those loops check
it themselves.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_fastdist.callbacks.lightning_internals import InstancePatches

log = logging.getLogger(__name__)


class CoordinatedSigterm:
    """Check for SIGTERM on all ranks together, every ``check_every_n_batches`` batches.

    Args:
        trainer: a trainer about to fit with more than one process.
        check_every_n_batches: training batches between two checks (>= 1).
    """

    def __init__(self, trainer: Trainer, check_every_n_batches: int) -> None:
        if check_every_n_batches < 1:
            raise ValueError(f"check_every_n_batches must be >= 1, got {check_every_n_batches}.")
        self.trainer = trainer
        self.check_every_n_batches = check_every_n_batches
        self.signalled = False
        self._batches_started = 0
        self._flag: torch.Tensor | None = None
        self._patches = InstancePatches()

    def install(self) -> None:
        """Replace Lightning's per-batch broadcast and its broadcasting signal handler on this trainer.

        Must run before Lightning registers its signal handlers (a callback's ``setup`` hook does).
        """
        self._flag = torch.zeros(1, dtype=torch.int32, device=self.trainer.strategy.root_device)
        self._patches.replace(self.trainer._signal_connector, "_sigterm_notifier_fn", self._on_sigterm)
        self._patches.replace(self.trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", self._before_batch)

    def uninstall(self) -> None:
        """Put Lightning's own methods back."""
        self._patches.undo()

    def _on_sigterm(self, signum: signal.Signals | int, _: FrameType | None) -> None:
        log.info(f"[rank {self.trainer.global_rank}] received SIGTERM ({signum}); all ranks stop at the next check")
        launcher = self.trainer.strategy.launcher
        if not self.signalled and launcher is not None:
            launcher.kill(signum)
        self.signalled = True
        if not self.trainer.training:
            self.trainer._signal_connector.received_sigterm = True

    def _before_batch(self) -> None:
        due = self._batches_started > 0 and self._batches_started % self.check_every_n_batches == 0
        self._batches_started += 1
        if due and self.agree_on_sigterm():
            raise SIGTERMException()

    def agree_on_sigterm(self) -> bool:
        """Collective: True on every rank if any rank was signalled (then ``trainer.received_sigterm`` is set)."""
        assert self._flag is not None, "install() first"
        self._flag.fill_(1 if self.signalled else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        stop = bool(self._flag.item())  # the one host read of a check
        if stop:
            self.trainer._signal_connector.received_sigterm = True
        return stop
