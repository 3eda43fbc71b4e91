"""What every strategy of this package does on Lightning's hooks besides its engine's own work: the preemption
handler, checkpoints that are finite and resume exactly, the communication metrics, the form of training across
nodes, and a lost peer named in one line. Each strategy owns a :class:`SharedHooks` and calls it from its own
``@override`` hooks, so a strategy file still shows everything it does on each hook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn

from lightning_fastdist.parallel.comm.accounting import CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock
from lightning_fastdist.strategies.across_nodes import OneWorld
from lightning_fastdist.strategies.checkpoint.exact_resume import ResumeState
from lightning_fastdist.strategies.checkpoint.fault_tolerance import refuse_non_finite
from lightning_fastdist.strategies.common.comm_metrics import CommMetricsLog, end_comm_step
from lightning_fastdist.strategies.common.job import explain_lost_peer_of_job
from lightning_fastdist.trainer.loop_state import align_resumed_batch_count
from lightning_fastdist.trainer.preemption import PreemptionHandler


class SharedHooks:
    """The hooks' shared part for one strategy.

    Args:
        across_nodes: the strategy's form of training across nodes (:func:`~.across_nodes.across_nodes`).
        log_comm_bytes: log each collective's bytes per optimizer step and the exposed wait (``comm/*``).

    Attributes:
        resume: this rank's random states for the first training batch after a checkpoint was saved or loaded.
    """

    def __init__(self, across_nodes: OneWorld | None = None, log_comm_bytes: bool = True) -> None:
        self.across_nodes = across_nodes if across_nodes is not None else OneWorld()
        self.log_comm_bytes = log_comm_bytes
        self.resume = ResumeState()
        self._comm_log = CommMetricsLog()
        self._preemption: PreemptionHandler | None = None

    def setup(self, trainer: pl.Trainer, timeout: timedelta) -> None:
        """Install the preemption handler: first in a strategy's ``setup``, since it agrees with the other ranks."""
        self._preemption = PreemptionHandler(trainer, timeout)
        self._preemption.install()

    def on_train_start(
        self,
        model: nn.Module,
        module: pl.LightningModule,
        optimizers: Sequence[torch.optim.Optimizer],
        timeout: timedelta,
        stats: CommStats | None,
        clock: ExposedCommClock | None,
    ) -> None:
        """A new fit logs into new results; training across nodes starts once Lightning restored a checkpoint's state
        (a node's own state goes on top of it); the resumed epoch's batch count follows its training loader."""
        self._comm_log.new_fit()
        self.across_nodes.start(model, module, optimizers, timeout, self.resume, stats, clock)
        align_resumed_batch_count(module.trainer)

    def before_batch(self) -> None:
        """First in ``on_train_batch_start``: the random states kept for this batch, the step's quorum started."""
        self.resume.before_batch()
        self.across_nodes.before_batch()

    def after_training_step(
        self,
        output: Any,
        module: pl.LightningModule | None,
        stats: CommStats | None,
        collectives: Sequence[str],
        clock: ExposedCommClock | None,
        extra: Mapping[str, float] | None = None,
    ) -> Any:
        """Return a training step's ``output`` once the last optimizer step's bytes per collective, its exposed wait and
        ``extra`` are logged (from inside the step: a manual optimizer step in it counts)."""
        if self.log_comm_bytes:
            self._comm_log.log(module, stats, collectives, clock, extra)
        return output

    def after_optimizer_step(
        self, trainer: pl.Trainer, stats: CommStats | None, clock: ExposedCommClock | None
    ) -> None:
        """The step's communication count and exposed time closed; where training stands kept for a node that
        rejoins."""
        self.across_nodes.after_step(trainer)
        end_comm_step(stats, clock)

    def prepare_save(self, strategy: ParallelStrategy, checkpoint: dict[str, Any], filepath: Any) -> bool:
        """Before a strategy writes ``checkpoint`` (call on every rank): refuse a non-finite state on every rank, add
        the random states an exact resume needs, and let the form across nodes write its own part. Return whether
        this process's world writes the checkpoint (one node writes what the nodes share)."""
        refuse_non_finite(strategy, checkpoint, filepath)
        self.resume.add_to(checkpoint, *self.across_nodes.resume_ranks(strategy))
        trainer = strategy.lightning_module.trainer
        self.across_nodes.save(strategy.model, strategy.optimizers, checkpoint, filepath, trainer)
        return self.across_nodes.writes_checkpoint(strategy.node_rank)

    def take_loaded(self, strategy: ParallelStrategy, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """After a strategy loaded ``checkpoint``: keep its random states for the next training batch (a node's own
        under a world per node), and what the form across nodes keeps of it (applied when training starts)."""
        self.resume.take_from(checkpoint, *self.across_nodes.resume_ranks(strategy))
        self.across_nodes.load(checkpoint, checkpoint_path, strategy.lightning_module.trainer)

    def on_exception(self, exception: BaseException, timeout: timedelta, rank: int) -> None:
        """Name a peer lost during a collective in one line."""
        explain_lost_peer_of_job(exception, timeout, rank)

    def teardown(self) -> None:
        """Stop training across nodes and give the signal handlers back."""
        self.across_nodes.teardown()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
