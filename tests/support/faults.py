"""Test-only callbacks that inject real faults into a training run (a SIGKILL, a hang) and write results to disk.

They are importable by class path (``tests.support.faults.KillOnce``) so that a YAML
recipe given to ``lightning-fastdist`` under ``torchrun`` can use them; run with
the repository root on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import lightning as L


class KillOnce(L.Callback):
    """SIGKILL this process after optimizer step ``at_step`` on rank ``rank``, once per ``marker`` file.

    The marker is written just before the kill, so a run restarted from a
    checkpoint (which passes ``at_step`` again) is not killed a second time.

    Args:
        at_step: the global step after which to die.
        rank: the global rank that dies.
        marker: a file that records that the kill already happened.
        hang: instead of dying, sleep (a stuck rank that never reaches its next collective).
    """

    def __init__(self, at_step: int, rank: int, marker: str, hang: bool = False) -> None:
        self.at_step = at_step
        self.rank = rank
        self.marker = Path(marker)
        self.hang = hang

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.at_step or trainer.global_rank != self.rank or self.marker.exists():
            return
        self.marker.write_text(f"{'hung' if self.hang else 'killed'} rank {self.rank} after step {self.at_step}\n")
        if self.hang:
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)


class WriteFinalLoss(L.Callback):
    """Rank 0 writes ``{"step": global_step, "loss": last train_loss}`` as JSON to ``path`` when training ends.

    Args:
        path: the JSON file to write.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            loss = float(trainer.callback_metrics["train_loss"])
            self.path.write_text(json.dumps({"step": trainer.global_step, "loss": loss}))
