"""One node's side of the outer synchronisation, on torchft: its ``Manager`` and its ``DiLoCo``.

``DiLoCo`` hooks the inner optimizer's ``step``: every ``every / fragments`` steps it starts one fragment's
pseudo-gradient all-reduce and applies the outer step ``delay`` steps later. Ours: the pseudo-gradient sent in bf16
and counted in ``comm/*``, and rejoining. Private torchft names are read for evaluation (fragments' global copies),
exact resume and rejoining (the schedule's position, the next fragment and its two halves of a sync).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lightning_fastdist.parallel.across_nodes.group import LEFT_OUT_AFTER, ReplicaGroup, import_torchft
from lightning_fastdist.parallel.across_nodes.node_run import NodeRun
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import PSEUDO_GRADIENT_DTYPES, OuterSync
from lightning_fastdist.parallel.across_nodes.rejoin import NodeState
from lightning_fastdist.parallel.comm.accounting import CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, TimedWork

OUTER_ALL_REDUCE = "outer_allreduce"  # logged as comm/outer_allreduce_bytes_per_step


class OuterSyncRun(NodeRun):
    """torchft's ``Manager`` and ``DiLoCo`` for a process that talks across nodes, with the inner optimizer's
    ``step`` hooked while open.

    Args:
        model: the model as trained (wrapped or not); its trainable parameters are made equal across nodes.
        timeout: for torchft's collectives and quorums.
        stats: the outer all-reduces are recorded as ``OUTER_ALL_REDUCE``.
        report: called with the line saying which nodes left or joined the quorum, and at which step.
        position: returns the training position a node that rejoins receives; where this node rejoined,
            ``rejoined`` holds the one it received.
    """

    def __init__(
        self,
        settings: OuterSync,
        model: nn.Module,
        fragments: Sequence[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        group: ReplicaGroup,
        timeout: timedelta,
        stats: CommStats | None = None,
        clock: ExposedCommClock | None = None,
        report: Callable[[str], object] | None = None,
        position: Callable[[], Any] = lambda: None,
    ) -> None:
        import_torchft("outer_sync")
        from torchft.local_sgd import DiLoCo

        # DiLoCo's requirement: a synchronous quorum.
        super().__init__(group, timeout, "outer_sync", "the sync", async_quorum=False, report=report)
        self.settings = settings
        self.fragments = list(fragments)
        if not self.joining:  # before DiLoCo copies the weights as the global ones
            self.start_with_equal_weights(model, timeout)
        self.outer_optimizers = [
            torch.optim.SGD(
                fragment.parameters(), lr=settings.lr, momentum=settings.momentum, nesterov=settings.nesterov
            )
            for fragment in fragments
        ]
        counted = _CountedManager(self.manager, PSEUDO_GRADIENT_DTYPES[settings.dtype], stats, clock)
        self.diloco = DiLoCo(
            counted,  # type: ignore[arg-type]  # the Manager's methods, the all-reduce counted and cast
            list(fragments),
            inner_optimizer,
            self.outer_optimizers,
            sync_every=settings.every,
            fragment_sync_delay=settings.delay,
            fragment_update_alpha=settings.mix,
        )
        self._node_state = NodeState(model, inner_optimizer, self._schedule, position)
        self.serve_state(self._node_state)
        self.diloco.__enter__()
        self.fragment_due = 0  # the fragment DiLoCo syncs at the next step that applies one
        self._hook = inner_optimizer.register_step_pre_hook(self._before_step)
        if self.joining:
            self._rejoin()

    def _schedule(self) -> dict[str, int]:
        return {"steps": self.steps, "local_step": self.diloco._local_step}

    def _rejoin(self) -> None:
        """Join nodes that have been training: at their next fragment's quorum torchft gives this node a live node's
        state, and it then does what they do after that quorum (start the fragment's all-reduce, and apply it where
        the schedule has no delay), so that it takes their next step with them."""
        self.manager.start_quorum()  # returns once the others came to a quorum, this node healed
        received = self._node_state.received
        if received is None:
            raise RuntimeError(
                f"outer_sync: node{self.group.node_rank} started while the other nodes train and received no state "
                f"from them (they had not applied an outer step yet, or the transfer failed: {self.manager.errored()}):"
                " restart the whole job, or start this node again once they applied one."
            )
        self._node_state.received = None
        self._node_state.restore(received)
        self.steps = received["schedule"]["steps"]
        self.diloco._local_step = received["schedule"]["local_step"]
        self.fragment_due = self.diloco._current_fragment()
        fragment = self.diloco._fragments[self.fragment_due]
        fragment.prepare_sync()
        if self.diloco._local_step == self.diloco._sync_every:
            fragment.perform_sync()
            self.diloco._local_step = 0
        self.rejoined = self.rejoined_with(received)
        if self.membership.report is not None:
            self.membership.report(
                f"outer_sync: node{self.group.node_rank} rejoined the job at step {self.steps} with the weights, "
                f"optimizer state and schedule of {self.rejoined.source} ({self.rejoined.received_bytes:,} bytes "
                "from its memory, not from a checkpoint): it trains on from the next step."
            )

    def _before_step(self, *_: Any) -> None:
        self.steps += 1
        self.fragment_due = self.manager.current_step() % len(self.outer_optimizers)  # as DiLoCo picks it

    def load_global_weights(self) -> None:
        """Copy the global weights (what the last outer step of each fragment left) into the model's parameters."""
        for fragment in self.diloco._fragments:  # torchft keeps each fragment's global copy on its fragment
            fragment.restore_parameters()

    def state_dict(self) -> dict[str, Any]:
        """What every node shares besides the global weights: the outer optimizers' state, torchft's step count."""
        outer = [optimizer.state_dict() for optimizer in self.outer_optimizers]
        return {"outer_optimizers": outer, "manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any], optimizer_steps: int) -> None:
        """Put back ``state_dict``'s state, after ``optimizer_steps`` inner steps of the run that saved it (the
        outer optimizers' where it holds them: a sharded node keeps theirs in its own shards)."""
        for optimizer, saved in zip(self.outer_optimizers, state.get("outer_optimizers", ())):
            optimizer.load_state_dict(saved)
        self.manager.load_state_dict(state["manager"])
        self.steps = optimizer_steps
        # Inner steps since the last fragment's sync: where DiLoCo's schedule stands (torchft keeps no public setter).
        self.diloco._local_step = optimizer_steps % self.settings.steps_between_fragments

    def wait_for_saves(self, step: int) -> list[str]:
        """Wait until this process's counterpart on every node of the latest quorum wrote its state of the checkpoint
        of ``step``, counted in node 0's store; return the nodes that did not within ``LEFT_OUT_AFTER`` (they left the
        job since). A node that joined at that quorum has no state to write: it is not waited for (a
        collective across the nodes would pair with its next one instead)."""
        membership, store = self.membership, self._register.store
        saving = [node for node in membership.quorum_nodes if membership.joined.get(node) != self.steps]
        key = f"outer_sync/{self._register.fit}/saved/{step}"
        store.set(f"{key}/node{self.group.node_rank}", "")
        if store.add(key, 1) == len(saving) * self.group.members:
            store.set(f"{key}/all", "")
        try:
            store.wait([f"{key}/all"], LEFT_OUT_AFTER)
        except torch.distributed.DistStoreError:
            return [node for node in saving if not store.check([f"{key}/{node}"])]
        return []

    @property
    def syncs(self) -> int:
        return self.manager.current_step()

    def close(self) -> None:
        """Unhook the inner optimizer, stop this rank's torchft servers and mark the nodes as no longer training in the
        register, so that a node that starts now starts a fit of its own."""
        self._hook.remove()
        self.diloco.__exit__(None, None, None)
        super().close()


class _CountedManager:
    """A ``Manager`` whose ``allreduce`` sends in ``dtype``, records its bytes and times its ``wait()``."""

    def __init__(
        self, manager: Any, dtype: torch.dtype, stats: CommStats | None, clock: ExposedCommClock | None
    ) -> None:
        self._manager = manager
        self._dtype = dtype
        self._stats = stats
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, **kwargs: Any) -> Any:
        sent = tensor if tensor.dtype == self._dtype else tensor.to(self._dtype)
        if self._stats is not None:
            self._stats.record(sent, OUTER_ALL_REDUCE)
        work = self._manager.allreduce(sent, should_quantize=should_quantize, **kwargs)
        if sent is not tensor:
            work = _CopiedBack(work, lambda: tensor.copy_(sent))
        return TimedWork(work, self._clock) if self._clock is not None else work


class _CopiedBack(torch.distributed.Work):
    """A work whose ``wait()`` also copies the reduced low-precision tensor back into the caller's."""

    def __init__(self, work: Any, copy_back: Callable[[], object]) -> None:
        super().__init__()
        self._work = work
        self._copy_back = copy_back

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        self._copy_back()
        return done

    def get_future(self) -> Any:
        return self._work.get_future()
