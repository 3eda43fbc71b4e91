"""What both forms across nodes (``outer_sync``, ``replica_groups``) do alike: each node a torch.distributed world of
its own and a torchft replica group, the processes that talk across nodes each running torchft's ``Manager``.

Under DDP each node's local rank 0 talks across nodes for its node and shares what it agreed on with the node's other
ranks; under FSDP (``sharded``) every rank talks with the ranks holding the same shard on the other nodes. Lightning
keeps the job's global ranks and world size; its own collectives stay within the node.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn

from lightning_fastdist.parallel.across_nodes.form_settings import FormSettings
from lightning_fastdist.parallel.across_nodes.group import ReplicaGroup
from lightning_fastdist.parallel.across_nodes.rejoin import Rejoined, load_optimizer_snapshot
from lightning_fastdist.strategies.across_nodes.interface import AcrossNodes, TrainingStart
from lightning_fastdist.strategies.across_nodes.node_process_groups import (
    NodeProcessGroups,
    broadcast_in_node,
    decide_in_node,
    share_in_node,
)
from lightning_fastdist.trainer.loop_state import continue_after


class TorchftForm(AcrossNodes):
    """The base of the two forms across nodes on torchft (``settings``: the form's; ``owner`` names the strategy in
    errors; ``sharded``: each rank of a node holds a shard of the weights, as under FSDP, instead of all of them).

    A form says what it refuses (:attr:`powersgd_refusal`, :attr:`hsdp_refusal`), what it runs in a process that talks
    across nodes (:meth:`_new_run`), and what it does once that run started (:meth:`_started`).
    """

    powersgd_refusal = ""  # why PowerSGD's per-rank state does not fit this form
    hsdp_refusal = ""  # why FSDP's HSDP does not either

    def __init__(self, settings: FormSettings, owner: str, sharded: bool) -> None:
        self.settings = settings
        self.option = settings.option
        self.owner = owner
        self.sharded = sharded
        self.process_groups = NodeProcessGroups(owner, settings.option, settings.min_nodes, sharded)
        self.run: Any = None  # this process's torchft run, where it talks across nodes, while fitting
        self.wrote_last_checkpoint = False  # whether this node wrote the latest checkpoint (writes_checkpoint)

    def comm_hook_inside_node(self, comm_hook: str) -> str:
        """``auto`` is ``none`` (inside a node gradients travel on fast links); PowerSGD is refused."""
        if comm_hook == "powersgd":
            raise ValueError(
                f"{self.powersgd_refusal} gradients travel on fast links: comm_hook='powersgd' is not taken with it; "
                "use comm_hook='none' (or 'bf16')."
            )
        return "none" if comm_hook == "auto" else comm_hook

    def check_sharding(self, sharding: str) -> None:
        if sharding == "hsdp":
            raise ValueError(
                f"{self.hsdp_refusal}: give sharding='zero3' or 'zero2' (sharded inside each node) with {self.option}."
            )

    def check_launch(self, num_nodes: int) -> None:
        """Refuse, before any process starts, one node, more ``min_nodes`` than nodes, or no torchft."""
        try:
            self.settings.check_nodes(num_nodes, "num_nodes")
        except ValueError as error:
            raise ValueError(f"{self.owner}: {error}") from None
        self.process_groups.check_can_start()

    def join(self, strategy: ParallelStrategy, backend: str, timeout: timedelta) -> None:
        """Join this node's own world (and on global rank 0 start the lighthouse)."""
        self.process_groups.join(strategy, backend, timeout)

    def resume_ranks(self, strategy: ParallelStrategy) -> tuple[int, int]:
        """The node's: a checkpoint keeps the random states of each node's ranks, each node's beside it."""
        return strategy.local_rank, strategy.num_processes

    def training_ranks(self, world_size: int) -> int:
        """The ranks of the nodes in the latest quorum (known where this process talks across nodes), else
        ``world_size``."""
        quorum_nodes = self.run.membership.quorum_nodes if self.run is not None else ()
        if not quorum_nodes:
            return world_size
        assert self.process_groups.group is not None
        return len(quorum_nodes) * self.process_groups.group.ranks_per_node

    def start(self, training: TrainingStart) -> None:
        """Start this node's side of the job (call when training starts, after Lightning restored a checkpoint's
        state): the weights made equal across nodes or, on a node restarted while the others train, a live node's
        state taken, and the loops set to where that node stands."""
        self._check_optimizers(training)
        self.close_run()  # a second fit in the same process starts afresh
        group = self.process_groups.group_of_this_fit()
        self._prepare(training)
        if group.talks_across_nodes:
            report = _warn if group.local_rank == 0 else None  # once per node
            self.run = self._new_run(training, group, report)
        rejoined: Rejoined | None = self.run.rejoined if self.run is not None else None
        optimizer = training.optimizers[0]
        if not self.sharded:  # local rank 0 agreed with the other nodes: it tells the node's other ranks
            rejoined = share_in_node(rejoined)
            broadcast_in_node(self._shared_in_node(training.model))
        if rejoined is not None:  # a live node's state, newer than any checkpoint this fit was given
            if self.run is None:  # local rank 0 loaded it; its weights came with the broadcast above
                load_optimizer_snapshot(optimizer, rejoined.inner_optimizer)
            continue_after(training.module.trainer, rejoined.position, rejoined.step)
        self._started(training.model, optimizer, rejoined)

    def _check_optimizers(self, training: TrainingStart) -> None:
        """Refuse, in one line, optimizers this form cannot step."""

    def _prepare(self, training: TrainingStart) -> None:
        """What every rank of the node sets up before its run starts."""

    def _new_run(self, training: TrainingStart, group: ReplicaGroup, report: Callable[[str], None] | None) -> Any:
        """This process's torchft run (it talks across nodes)."""
        raise NotImplementedError

    def _shared_in_node(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors local rank 0 sends the node's other ranks once its run started (not ``sharded``)."""
        return list(model.parameters())

    def _started(self, model: nn.Module, optimizer: torch.optim.Optimizer, rejoined: Rejoined | None) -> None:
        """After the run started (``rejoined``: how this node joined a running job, where it did)."""

    def evaluation_sampler(self, strategy: ParallelStrategy) -> dict[str, int] | None:
        """Training data is shared out over every rank of every node, evaluation data over the node's ranks only, so
        that every node evaluates all of it and gets the same metrics (Lightning's reductions and EarlyStopping's
        decision are within a node)."""
        module = strategy.lightning_module
        if module is None or module.trainer.training:
            return None
        return {"num_replicas": strategy.num_processes, "rank": strategy.local_rank}

    def reduce_boolean_decision(
        self,
        module: pl.LightningModule | None,
        decision: bool,
        all: bool,  # noqa: A002 - Lightning's name
        device: torch.device,
        in_world: Callable[[bool, bool], bool],
    ) -> bool:
        """Over the node's ranks, and where this form crosses nodes now over every node's."""
        return decide_in_node(decision, all, device, self._summed_across_nodes(module))

    def _summed_across_nodes(self, module: pl.LightningModule | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Where Lightning's reductions cross the nodes now, a function summing a node's tensor over them."""
        return None

    def writes_files(self, strategy: ParallelStrategy) -> bool:
        """Local rank 0 of the node that wrote the latest checkpoint."""
        return self.wrote_last_checkpoint and strategy.local_rank == 0

    def close_run(self) -> None:
        """Stop this process's torchft servers and this fit's store."""
        if self.run is not None:
            self.run.close()
            self.run = None
        self.process_groups.close_fit()

    def teardown(self) -> None:
        """Stop torchft's servers of this process (the lighthouse on global rank 0)."""
        self.close_run()
        self.process_groups.stop_lighthouse()


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=2)
