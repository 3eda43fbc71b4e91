"""One node's side of the outer synchronisation, on torchft: its lighthouse, its ``Manager`` and its ``DiLoCo``.

torchft (PyTorch's fault-tolerance library) is built for replica groups: each group is a torch.distributed world of
its own (here: one node, whose ranks keep averaging gradients every step), and a ``Manager`` per rank forms a quorum
of the groups through a lighthouse server and all-reduces across them on a process group it reconfigures per
quorum. ``DiLoCo`` hooks the inner optimizer's ``step``: every ``every / fragments`` steps it starts the quorum
and the all-reduce of one fragment's pseudo-gradient, and ``delay`` steps later applies the outer step.

What is ours: the lighthouse started by global rank 0 and stopped with the job (no extra command), every node
waiting for the others before the first quorum, the weights made equal across nodes before the first step, the
pseudo-gradient sent in bf16, its bytes and waiting counted in the strategy's ``comm/*`` metrics, one line when a
node leaves the quorum, and a node restarted while the others train joining them (:mod:`.rejoin`). torchft's public
API, and these private names: each fragment's global copy (for evaluation), DiLoCo's position in the schedule (for
exact resume and rejoining), the fragment it syncs next and its two halves of a sync (for rejoining: the node that
joins does what the others do after the quorum that brought it in), and the manager's client (to read which nodes
each quorum holds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from lightning_fastdist.parallel.comm.accounting import CommStats
from lightning_fastdist.parallel.comm.exposed import ExposedCommClock, TimedWork
from lightning_fastdist.parallel.fsdp.local_shards import local_part
from lightning_fastdist.parallel.semi_sync.rejoin import (
    NODE_STATE_KEY,
    CountedTransport,
    NodeState,
    Rejoined,
    load_optimizer_snapshot,
)
from lightning_fastdist.parallel.semi_sync.settings import PSEUDO_GRADIENT_DTYPES, OuterSync

INSTALL_HINT = "pip install lightning-fastdist[ft]"
OUTER_ALL_REDUCE = "outer_allreduce"  # logged as comm/outer_allreduce_bytes_per_step


def torchft_available() -> bool:
    """Whether ``torchft`` can be imported (without importing it)."""
    return importlib.util.find_spec("torchft") is not None


def import_torchft(owner: str) -> ModuleType:
    """``import torchft``, or an ``ImportError`` naming ``owner`` and the install command."""
    if not torchft_available():
        raise ImportError(f"{owner} needs torchft for outer_sync, which is not installed: {INSTALL_HINT}")
    import torchft

    return torchft


@dataclass(frozen=True)
class ReplicaGroup:
    """Where one node stands in the job, and where its torchft servers are.

    A node is one of torchft's replica groups. Where its ranks hold the same weights (DDP) one process talks
    across nodes for the node, its local rank 0: a replica group of one. Where each rank holds a shard (FSDP)
    every rank talks, with the ranks holding the same shard on the other nodes: a replica group of the node's ranks.

    Attributes:
        node_rank: this node's index; ``num_nodes`` in all.
        local_rank: this process's rank inside its node.
        sharded: whether each rank of the node holds its own shard of the weights (every rank talks across nodes).
        ranks_per_node: the node's processes.
        min_nodes: the fewest nodes a quorum may hold (fewer than ``num_nodes``: the job survives a lost node).
        store_host: an address of this node that the other nodes reach (its hostname): torchft's process groups
            across nodes rendezvous in the store of one node.
        store_port: the port of this node's store (the node's own torch.distributed world).
        lighthouse: ``http://HOST:PORT`` of the lighthouse.
        first_store: ``(host, port)`` of node 0's store, where the nodes wait for each other before the first quorum.
    """

    node_rank: int
    num_nodes: int
    local_rank: int
    sharded: bool
    ranks_per_node: int
    min_nodes: int
    store_host: str
    store_port: int
    lighthouse: str
    first_store: tuple[str, int]

    @property
    def talks_across_nodes(self) -> bool:
        """Whether this process runs torchft's ``Manager`` and ``DiLoCo`` (sends its weights' pseudo-gradients)."""
        return self.sharded or self.local_rank == 0

    @property
    def members(self) -> int:
        """Processes of the node that talk across nodes: torchft's replica group size."""
        return self.ranks_per_node if self.sharded else 1


TRAINING_KEY = "outer_sync/training"  # in node 0's store while the nodes train: a node that starts then rejoins
LEFT_OUT_AFTER = timedelta(seconds=30)  # a node that heartbeats but does not come to a sync for this long is left out


def start_lighthouse(port: int, min_nodes: int) -> Any:
    """Start torchft's lighthouse in this process, on every interface at ``port``; ``shutdown()`` stops it.

    A quorum holds every group that heartbeats (one whose heartbeat stops for 5 s is left out), and at least
    ``min_nodes``: once ``min_nodes`` asked, the lighthouse waits up to :data:`LEFT_OUT_AFTER` for the other
    heartbeating groups (torchft's default, 100 ms, would split nodes a few milliseconds apart into different
    quorums)."""
    import_torchft("outer_sync")
    from torchft.coordination import LighthouseServer

    join_timeout_ms = int(LEFT_OUT_AFTER.total_seconds() * 1000)
    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_nodes, join_timeout_ms=join_timeout_ms)


class OuterSyncRun:
    """torchft's ``Manager`` and ``DiLoCo`` for a process that talks across nodes
    (:attr:`ReplicaGroup.talks_across_nodes`), with the inner optimizer's ``step`` hooked while open.

    Args:
        settings: the outer synchronisation's options.
        model: the model as trained (wrapped or not); its trainable parameters are made equal across nodes.
        fragments: the fragments (:func:`~lightning_fastdist.parallel.semi_sync.fragments.split_into_fragments`).
        inner_optimizer: the optimizer the strategy steps every step.
        group: this rank's :class:`ReplicaGroup`.
        timeout: for torchft's collectives and quorums.
        stats: the strategy's byte counts; the outer all-reduces are recorded as :data:`OUTER_ALL_REDUCE`.
        clock: the strategy's exposed-communication clock; waiting for an outer all-reduce counts.
        report: called with the one line saying which nodes left or joined the quorum, and at which step (``None``:
            not said here).
        position: returns the training position a node that rejoins receives (``None`` by default); where this
            node rejoined, :attr:`rejoined` holds the one it received.
    """

    fitted_in_this_process = False  # whether a run started in this process before (then it never rejoins)

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
        torchft = import_torchft("outer_sync")
        from torchft.local_sgd import DiLoCo

        self.settings = settings
        self.group = group
        self.fragments = list(fragments)
        self._transport = CountedTransport(timeout)
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=group.min_nodes,
            use_async_quorum=False,  # DiLoCo's requirement
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=group.local_rank if group.sharded else 0,
            world_size=group.members,
            store_addr=group.store_host,
            store_port=group.store_port,
            lighthouse_addr=group.lighthouse,
            replica_id=f"node{group.node_rank}",
            init_sync=False,  # the weights are made equal below, through the public all-reduce
            checkpoint_transport=cast(Any, self._transport),  # torchft's HTTP transport, its bytes counted
        )
        self.steps = 0  # optimizer steps of this fit, counted before each
        self.quorum_nodes: tuple[str, ...] = ()  # the nodes of the latest quorum
        self._quorum_replicas: tuple[str, ...] = ()  # its torchft replica ids (a restarted node has a new one)
        self._joined: dict[str, int] = {}  # the nodes that came back, and at which step
        self.rejoined: Rejoined | None = None
        self._report = report
        self._recovery_source: str | None = None
        self.manager._client = _QuorumMembers(self.manager._client, self._note_members)
        first_store = torch.distributed.TCPStore(
            *group.first_store, is_master=False, timeout=timeout, wait_for_workers=False
        )
        # A process that fitted before is one of the job's own (a second fit); one that did not, started while the
        # others train, was restarted.
        joining = first_store.check([TRAINING_KEY]) and not OuterSyncRun.fitted_in_this_process
        OuterSyncRun.fitted_in_this_process = True
        if joining:
            self._fit = first_store.get(TRAINING_KEY).decode()
        else:
            self._fit = str(_wait_for_every_node(first_store, group))
            self._equalize(model)
            if group.node_rank == 0:
                first_store.set(TRAINING_KEY, self._fit)
        self._first_store = first_store
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
        self.manager.register_state_dict_fn(NODE_STATE_KEY, self._node_state.receive, self._node_state.snapshot)
        self.diloco.__enter__()
        self.fragment_due = 0  # the fragment DiLoCo syncs at the next step that applies one
        self._hook = inner_optimizer.register_step_pre_hook(self._before_step)
        if joining:
            self._rejoin()

    def _schedule(self) -> dict[str, int]:
        """Where the schedule stands, as a node that rejoins takes it (read in the optimizer step's hook)."""
        return {"steps": self.steps, "local_step": self.diloco._local_step}

    def _rejoin(self) -> None:
        """Join nodes that have been training: at their next fragment's quorum torchft gives this node a live node's
        state (:mod:`.rejoin`), and it then does what they do after that quorum (start the fragment's all-reduce,
        and apply it where the schedule has no delay), so that it takes their next step with them."""
        self.manager.start_quorum()  # returns once the others came to a quorum, this node healed
        received = self._node_state.received
        if received is None:
            raise RuntimeError(
                f"outer_sync: node{self.group.node_rank} started while the other nodes train and received no state "
                f"from them (they had not applied an outer step yet, or the transfer failed: {self.manager.errored()}):"
                " restart the whole job, or start this node again once they applied one."
            )
        self._node_state.received = None
        self._node_state.restore_weights(received["weights"])
        load_optimizer_snapshot(self._node_state.optimizer, received["optimizer"])
        schedule = received["schedule"]
        self.steps = schedule["steps"]
        self.diloco._local_step = schedule["local_step"]
        self.fragment_due = self.diloco._current_fragment()
        fragment = self.diloco._fragments[self.fragment_due]
        fragment.prepare_sync()
        if self.diloco._local_step == self.diloco._sync_every:
            fragment.perform_sync()
            self.diloco._local_step = 0
        self.rejoined = Rejoined(
            source=self._recovery_source or "?",
            step=self.steps,
            received_bytes=self._transport.received_bytes,
            position=received["position"],
            inner_optimizer=received["optimizer"],
        )
        if self._report is not None:
            self._report(
                f"outer_sync: node{self.group.node_rank} rejoined the job at step {self.steps} with the weights, "
                f"optimizer state and schedule of {self.rejoined.source} ({self.rejoined.received_bytes:,} bytes "
                "from its memory, not from a checkpoint): it trains on from the next step."
            )

    def _before_step(self, *_: Any) -> None:
        self.steps += 1
        self.fragment_due = self.manager.current_step() % len(self.outer_optimizers)  # as DiLoCo picks it

    def _note_members(self, replicas: tuple[str, ...], source: str | None) -> None:
        """After each quorum (``replicas``: its members, ``node2:<uuid>`` each): report the nodes that left it and
        those that joined it since the previous one (``source``: the node this one heals from, if it does)."""
        before = self._quorum_replicas
        left = _nodes(replica for replica in before if replica not in replicas)
        joined = _nodes(replica for replica in replicas if before and replica not in before)
        lost = tuple(node for node in left if node not in joined)  # a node restarted in time is both: it came back
        self._quorum_replicas = replicas
        self.quorum_nodes = _nodes(replicas)
        self._recovery_source = source
        if self._report is None:
            return
        training = f"{len(self.quorum_nodes)} of {self.group.num_nodes} nodes train on"
        if lost:
            self._report(
                f"outer_sync: {', '.join(lost)} left the job at step {self.steps} (no heartbeat for 5 s, or not at the "
                f"sync within {LEFT_OUT_AFTER.seconds} s): {training}; the data the lost nodes read is not trained "
                "from here (docs/fault-tolerance.md)."
            )
        self._joined.update(dict.fromkeys(joined, self.steps))
        if joined:
            self._report(f"outer_sync: {', '.join(joined)} came back at step {self.steps} (restarted): {training}.")

    def _equalize(self, model: nn.Module) -> None:
        """Give every node the weights of the quorum's first node, bit for bit: the others send zeros into a summing
        all-reduce (torch seeds may differ between nodes; DDP does the same inside a node with a broadcast). Each
        process sends what it holds: the whole weights, or its shard of them."""
        self.manager.start_quorum()
        keeps_its_own = self.manager.participating_rank() == 0
        with torch.no_grad():
            for parameter in model.parameters():
                held = local_part(parameter)
                if not keeps_its_own:
                    held.zero_()
                self.manager.allreduce(held, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            raise RuntimeError(f"outer_sync: making the weights equal across nodes failed: {self.manager.errored()}")

    def load_global_weights(self) -> None:
        """Copy the global weights (what the last outer step of each fragment left) into the model's parameters."""
        for fragment in self.diloco._fragments:  # torchft keeps each fragment's global copy on its fragment
            fragment.restore_parameters()

    def state_dict(self) -> dict[str, Any]:
        """What every node shares besides the global weights: the outer optimizers' state, torchft's step count."""
        outer = [optimizer.state_dict() for optimizer in self.outer_optimizers]
        return {"outer_optimizers": outer, "manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any], optimizer_steps: int) -> None:
        """Put back :meth:`state_dict`'s state, after ``optimizer_steps`` inner steps of the run that saved it (the
        outer optimizers' where it holds them: a sharded node keeps theirs in its own shards)."""
        for optimizer, saved in zip(self.outer_optimizers, state.get("outer_optimizers", ())):
            optimizer.load_state_dict(saved)
        self.manager.load_state_dict(state["manager"])
        self.steps = optimizer_steps
        # Inner steps since the last fragment's sync: where DiLoCo's schedule stands (torchft keeps no public setter).
        self.diloco._local_step = optimizer_steps % self.settings.steps_between_fragments

    def wait_for_saves(self, step: int) -> list[str]:
        """Wait until this process's counterpart on every node of the latest quorum wrote its state of the checkpoint
        of ``step``, counted in node 0's store; return the nodes that did not within :data:`LEFT_OUT_AFTER` (they
        left the job since). A node that joined at that quorum has no state to write: it is not waited for (a
        collective across the nodes would pair with its next one instead)."""
        saving = [node for node in self.quorum_nodes if self._joined.get(node) != self.steps]
        key = f"outer_sync/{self._fit}/saved/{step}"
        self._first_store.set(f"{key}/node{self.group.node_rank}", "")
        if self._first_store.add(key, 1) == len(saving) * self.group.members:
            self._first_store.set(f"{key}/all", "")
        try:
            self._first_store.wait([f"{key}/all"], LEFT_OUT_AFTER)
        except torch.distributed.DistStoreError:
            return [node for node in saving if not self._first_store.check([f"{key}/{node}"])]
        return []

    @property
    def syncs(self) -> int:
        """Outer steps applied so far (torchft's committed steps)."""
        return self.manager.current_step()

    def close(self) -> None:
        """Unhook the inner optimizer and stop this rank's torchft servers (node 0: the nodes no longer train, so a
        node that starts now starts a fit of its own)."""
        self._hook.remove()
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.group.node_rank == 0 and self.group.local_rank == 0:
            self._first_store.delete_key(TRAINING_KEY)


def _wait_for_every_node(store: torch.distributed.Store, group: ReplicaGroup) -> int:
    """Return once every process that talks across nodes got here, counted in node 0's ``store``: the first quorum
    then holds every node (a quorum may hold fewer than all once ``min_nodes`` allows it, and a node that came late
    would miss the weights made equal). Returns which fit of the job this is (1, 2, ...)."""
    arrived = store.add("outer_sync/arrived", 1)
    everyone = group.num_nodes * group.members
    fit = (arrived - 1) // everyone + 1
    if arrived % everyone == 0:  # the last of this fit's arrivals (a second fit in the same job counts on)
        store.set(f"outer_sync/everyone/{fit}", "")
    store.wait([f"outer_sync/everyone/{fit}"])
    return fit


class _QuorumMembers:
    """torchft's manager client, telling ``note`` the nodes of each quorum it receives (``node3``, ...), and the node
    this one heals from where it does."""

    def __init__(self, client: Any, note: Callable[[tuple[str, ...], str | None], None]) -> None:
        self._client = client
        self._note = note

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        source = quorum.replica_ids[quorum.recover_src_replica_rank] if quorum.heal else None  # in replica rank order
        self._note(tuple(quorum.replica_ids), _nodes([source])[0] if source else None)
        return quorum


def _nodes(replicas: Iterable[str]) -> tuple[str, ...]:
    """The nodes of torchft replica ids (``node2:<uuid>``: ``node2``), sorted."""
    return tuple(sorted(replica.split(":")[0] for replica in replicas))


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
