"""What every strategy of this package does on Lightning's hooks besides its engine's own work: the preemption
handler, checkpoints that are finite and resume exactly, the communication metrics, the form of training across
nodes, and a lost peer named in one line. Each strategy owns a :class:`SharedHooks` and calls it from its own
``@override`` hooks, so a strategy file still shows everything it does on each hook.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_fastdist.data.plain_resume import continue_epoch
from lightning_fastdist.parallel.checkpoint.folder_lock import release_folders
from lightning_fastdist.strategies.across_nodes import AcrossNodes, OneWorld, TrainingStart
from lightning_fastdist.strategies.checkpoint.exact_resume import ResumeState
from lightning_fastdist.strategies.checkpoint.fault_tolerance import claim_checkpoint_folder, refuse_non_finite
from lightning_fastdist.strategies.checkpoint.saves import CheckpointSaves
from lightning_fastdist.strategies.common.comm_metrics import CommMetricsLog, end_comm_step
from lightning_fastdist.strategies.common.job import explain_lost_peer_of_job
from lightning_fastdist.trainer.loop_state import (
    align_resumed_batch_count,
    resumed_mid_epoch,
    start_the_next_epoch,
    training_loader_mode,
    training_loaders,
)
from lightning_fastdist.trainer.preemption import PreemptionHandler


class SharedHooks:
    """The hooks' shared part for one strategy, called one way: from the strategy's hook of the same name, with what
    only that hook knows; everything else is read from the strategy when the hook runs.

    Args:
        strategy: the strategy that owns it; besides Lightning's attributes it has ``timeout``, ``comm_stats``,
            ``exposed_comm`` and ``comm_collectives`` (what its engine counts, once counted).
        across_nodes: the strategy's form of training across nodes (:func:`~.across_nodes.across_nodes`).
        log_comm_bytes: log each collective's bytes per optimizer step and the exposed wait (``comm/*``).
        async_checkpointing: write checkpoints in the background during a fit (:class:`~.saves.CheckpointSaves`).

    Attributes:
        resume: this rank's random states of a loaded checkpoint, until the point of the data where they apply.
        saves: where the strategy's checkpoint writes go.
    """

    def __init__(
        self,
        strategy: ParallelStrategy,
        across_nodes: AcrossNodes | None = None,
        log_comm_bytes: bool = True,
        async_checkpointing: bool = False,
    ) -> None:
        self.strategy = strategy
        self.saves = CheckpointSaves(strategy, async_checkpointing)
        self.across_nodes = across_nodes if across_nodes is not None else OneWorld()
        self.log_comm_bytes = log_comm_bytes
        self.resume = ResumeState()
        self._comm_log = CommMetricsLog()
        self._preemption: PreemptionHandler | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        """Install the preemption handler and make the background saves' group: first in a strategy's ``setup``,
        since both are collectives."""
        self._preemption = PreemptionHandler(trainer, self.strategy.timeout)
        self._preemption.install()
        self.saves.setup()

    def on_train_start(self) -> None:
        """A new fit logs into new results; training across nodes starts once Lightning restored a checkpoint's state
        (a node's own state goes on top of it); the resumed epoch's batch count follows its training loader."""
        strategy = self.strategy
        module = strategy.lightning_module
        assert strategy.model is not None and module is not None
        self._comm_log.new_fit()
        self.across_nodes.start(
            TrainingStart(
                strategy.model,
                module,
                strategy.optimizers,
                strategy.timeout,
                strategy.comm_stats,
                strategy.exposed_comm,
            )
        )
        align_resumed_batch_count(module.trainer)

    def before_batch(self) -> None:
        """First in ``on_train_batch_start``: the random states kept for this batch, the step's quorum started."""
        self.resume.before_batch()
        self.across_nodes.before_batch()

    def after_training_step(self, output: Any, extra: Mapping[str, float] | None = None) -> Any:
        """Return a training step's ``output`` once the last optimizer step's bytes per collective, its exposed wait and
        ``extra`` are logged (from inside the step: a manual optimizer step in it counts)."""
        strategy = self.strategy
        if self.log_comm_bytes:
            self._comm_log.log(
                strategy.lightning_module,
                strategy.comm_stats,
                strategy.comm_collectives,
                strategy.exposed_comm,
                extra,
            )
        return output

    def after_optimizer_step(self) -> None:
        """The step's communication count and exposed time closed; where training stands kept for a node that
        rejoins."""
        module = self.strategy.lightning_module
        assert module is not None
        self.across_nodes.after_step(module.trainer)
        end_comm_step(self.strategy.comm_stats, self.strategy.exposed_comm)

    def prepare_save(self, checkpoint: dict[str, Any], filepath: Any) -> bool:
        """Before a strategy writes ``checkpoint`` (call on every rank): refuse a non-finite state on every rank, add
        the random states an exact resume needs, and let the form across nodes write its own part. Return whether
        this process's world writes the checkpoint (one node writes what the nodes share)."""
        strategy = self.strategy
        trainer = attached_trainer(strategy)
        claim_checkpoint_folder(strategy, checkpoint, filepath, trainer)  # one run saves there at a time
        if trainer is None:  # saved outside the fit's ranks (no collective): as Lightning saves it
            return self.across_nodes.writes_checkpoint(strategy.node_rank)
        refuse_non_finite(strategy, checkpoint, filepath)
        ranks = self.across_nodes.resume_ranks(strategy)
        self.resume.add_to(checkpoint, *ranks, training_loaders(trainer), trainer.num_training_batches)
        self.across_nodes.save(strategy.model, strategy.optimizers, checkpoint, filepath, trainer)
        return self.across_nodes.writes_checkpoint(strategy.node_rank)

    def take_loaded(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """After a strategy loaded ``checkpoint``: keep its random states for the next training batch (a node's own
        under a world per node), and what the form across nodes keeps of it (applied when training starts)."""
        strategy = self.strategy
        trainer = attached_trainer(strategy)
        if trainer is None:  # read outside a fit: nothing to resume
            return
        self.across_nodes.load(
            checkpoint, checkpoint_path, trainer
        )  # first: a node's own random states replace node 0's
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.resume.take_from(checkpoint, *self.across_nodes.resume_ranks(strategy), fitting)

    def training_data(self, dataloader: object) -> object:
        """In ``process_dataloader``: as a fit sets up its training loaders, before Lightning starts them, the random
        states of a checkpoint that ended an epoch go back, a ``max_steps`` fit resumed there starts the next epoch,
        the sampler is set to the epoch the fit starts in (Lightning
        sets it only after starting the loader, whose workers already drew a resumed epoch's first indices from the
        epoch before), and a plain loader resumed inside an epoch continues where the checkpoint's run stopped (each
        loader of a ``CombinedLoader`` where it stood)."""
        module = self.strategy.lightning_module
        if module is None or not module.trainer.training:
            return dataloader
        self.resume.before_training_data()
        start_the_next_epoch(module.trainer)
        _set_sampler_epoch(dataloader, module.trainer.fit_loop.epoch_progress.current.processed)
        resumed = resumed_mid_epoch(module.trainer)
        if resumed is None:
            return dataloader
        return continue_epoch(dataloader, *resumed, functools.partial(training_loader_mode, module.trainer))

    def on_exception(self, exception: BaseException) -> None:
        """Name a peer lost during a collective in one line; finish the checkpoint being written (or leave it
        unpublished)."""
        explain_lost_peer_of_job(exception, self.strategy.timeout, self.strategy.global_rank)
        self.saves.on_exception()

    def teardown(self) -> None:
        """Publish the checkpoint being written, stop training across nodes, give the signal handlers back and let
        other runs save where this one did."""
        self.saves.teardown()
        self.across_nodes.teardown()
        release_folders()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None


def attached_trainer(strategy: ParallelStrategy) -> pl.Trainer | None:
    """The trainer ``strategy``'s LightningModule is attached to, or ``None``: in the main process after a fit that
    started its ranks with ``spawn`` or ``fork`` (Lightning attaches the module in the ranks only), or where a module
    was given to the strategy directly, ``trainer.save_checkpoint`` and the strategy's own ``save_checkpoint`` work as
    Lightning's do."""
    module = strategy.lightning_module
    return module._trainer if module is not None else None
