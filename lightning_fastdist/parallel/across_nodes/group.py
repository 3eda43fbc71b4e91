"""What every form of training across torchft replica groups (one per node) shares: where a node stands, the register
where the nodes meet (node 0's store, or a coordinator's), the weights made equal at a fit's start, and who each quorum
holds (torchft's servers: ``torchft_servers.py``). Two private torchft names are read (``torchft_names.py``): the
manager's client and its quorum call, to see which nodes each quorum holds.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import nn

from lightning_fastdist.parallel.across_nodes.torchft_names import require_torchft_names
from lightning_fastdist.parallel.faults.job_identity import claim_or_check_run_id, launch_run_id
from lightning_fastdist.parallel.faults.listeners import url_host
from lightning_fastdist.parallel.fsdp.local_shards import local_part

INSTALL_HINT = "pip install lightning-fastdist[ft]"
COORDINATOR_VARIABLE = "LIGHTNING_FASTDIST_COORDINATOR"  # HOST:PORT of a coordinator outside the nodes
TRAINING_KEY = "outer_sync/training"  # in the register while the nodes train: a node that starts then rejoins
LIGHTHOUSE_KEY = "lighthouse"  # in the register: the lighthouse's URL (it listens on a port of its own choosing)
TRANSPORT_TOKEN_KEY = "transport_token"  # in the register: what a request for a node's state must name
QUORUM_RETRY_S = 0.1  # between quorums asked for again at a fit's start, while one lacks a node
REJOIN_POLL_S = 1.0  # between looks at the register while a restarted node waits for the quorum that takes it back
LEFT_OUT_AFTER = timedelta(seconds=30)  # a node that heartbeats but does not come to a quorum for this long is left out
# torchft's Rust side (manager, lighthouse) logs every quorum and commit at INFO on stderr: several lines per rank and
# step. It reads RUST_LOG once, when it is first imported; unless the user set RUST_LOG, it then reads this level.
TORCHFT_LOG_LEVEL = "warn"


class JobEndedError(RuntimeError):
    """A restarted node found the nodes training, and they ended the job before a quorum took it back."""


def torchft_available() -> bool:
    return importlib.util.find_spec("torchft") is not None


def is_first_node(quorum_nodes: tuple[str, ...], node_rank: int) -> bool:
    """Whether node ``node_rank`` is the first node of the latest quorum (node 0 before any): the one that speaks for
    the job, which may not be node 0 once node 0 was lost (with a coordinator)."""
    return (quorum_nodes[0] if quorum_nodes else "node0") == f"node{node_rank}"


def import_torchft(owner: str) -> ModuleType:
    """``import torchft``, or an ``ImportError`` naming ``owner`` and the install command; a torchft whose private
    names we read have moved is refused in one line (``torchft_names.py``). Imported here first, its Rust side logs at
    ``TORCHFT_LOG_LEVEL`` unless ``RUST_LOG`` says otherwise (the environment is left as it was)."""
    if not torchft_available():
        raise ImportError(f"{owner} needs torchft, which is not installed: {INSTALL_HINT}")
    if "torchft" not in sys.modules and "RUST_LOG" not in os.environ:
        os.environ["RUST_LOG"] = TORCHFT_LOG_LEVEL
        try:
            import torchft
        finally:
            del os.environ["RUST_LOG"]
    import torchft

    require_torchft_names(owner)
    return torchft


@dataclass(frozen=True)
class ReplicaGroup:
    """Where one node stands in the job, and where its torchft servers are.

    With the same weights on every rank (DDP) local rank 0 talks across nodes for the node: a replica group of one.
    With a shard per rank (FSDP) every rank talks with the ranks holding the same shard on the other nodes.

    Attributes:
        min_nodes: the fewest nodes a quorum may hold (fewer than ``num_nodes``: the job survives a lost node).
        store_host: this node's address on the route to the others (``listeners.job_address``): its listeners bind
            it, and torchft's process groups across nodes rendezvous in the store of one node there.
        store_port: the port of the store of this node's ``Manager`` (the fit's own).
        first_store: ``(host, port)`` of the register's store (node 0's, or a coordinator's), where the nodes meet.
        fit: which fit of the job this is (1, 2, ...: ``FitRegister.count_fit``); 0 before a fit.
        transport_token: the job's secret that a request for a node's state must name (``state_transport.py``).
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
    fit: int = 0
    transport_token: str = ""

    @property
    def talks_across_nodes(self) -> bool:
        """Whether this process runs torchft's ``Manager`` (sends across nodes for its node, or for its shard)."""
        return self.sharded or self.local_rank == 0

    @property
    def members(self) -> int:
        """Processes of the node that talk across nodes: torchft's replica group size."""
        return self.ranks_per_node if self.sharded else 1


def coordinator_at(address: str) -> tuple[str, int]:
    """The register's ``(HOST, PORT)`` of the coordinator at ``address`` (``HOST:PORT``, as ``lightning-fastdist
    coordinator`` prints it); its lighthouse's URL is in the register. Both outlive any node, node 0 included."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(
            f"{COORDINATOR_VARIABLE}={address!r} must be HOST:PORT of a running `lightning-fastdist coordinator` "
            "(e.g. 10.0.0.5:29400)."
        )
    return host.strip("[]"), int(port)


def register_client(first_store: tuple[str, int], timeout: timedelta) -> torch.distributed.TCPStore:
    """A connection to the job's register (node 0's store, or a coordinator's), waiting for it within ``timeout``."""
    return torch.distributed.TCPStore(*first_store, is_master=False, timeout=timeout, wait_for_workers=False)


def lighthouse_in(register: torch.distributed.Store) -> str:
    """The URL of the job's lighthouse, from its register (waits for it, within the store's timeout)."""
    return register.get(LIGHTHOUSE_KEY).decode()


def transport_token_in(register: torch.distributed.Store) -> str:
    """The job's secret for its state transport: the register's, made by the first process that asks."""
    return register.compare_set(TRANSPORT_TOKEN_KEY, "", secrets.token_hex(16)).decode()


def equalize_weights(manager: Any, model: nn.Module, owner: str, membership: Membership, timeout: timedelta) -> None:
    """Give every node the weights and buffers of the quorum's first node, bit for bit: the others send zeros into a
    summing all-reduce (torch seeds may differ between nodes; DDP does the same inside a node with a broadcast). Each
    process sends what it holds: the whole weights, or its shard of them.

    Starts quorums of its own until one holds every node (each arrived at the fit's start), or ``timeout`` passes:
    the lighthouse forms a quorum at once from the nodes it has heard from, so a node whose manager had not sent its
    first heartbeat yet was left out and, still making its weights equal, met the others' first step (gloo failed on
    sizes that did not match). ``membership`` forgets a short quorum: the nodes it lacked did not leave."""
    deadline = time.monotonic() + timeout.total_seconds()
    manager.start_quorum()
    while manager.num_participants() < membership.num_nodes and time.monotonic() < deadline:
        membership.forget_quorum()
        time.sleep(QUORUM_RETRY_S)
        manager.start_quorum()
    keeps_its_own = manager.participating_rank() == 0
    buffers = [buffer for buffer in model.buffers() if buffer.dtype != torch.bool]  # gloo sums no booleans
    with torch.no_grad():
        for tensor in [*model.parameters(), *buffers]:
            held = local_part(tensor)
            if not keeps_its_own:
                held.zero_()
            manager.allreduce(held, reduce_op=torch.distributed.ReduceOp.SUM).wait()
    if manager.errored() is not None:
        raise RuntimeError(f"{owner}: making the weights equal across nodes failed: {manager.errored()}")


class FitRegister:
    """The store where the nodes of a fit wait for each other, and where a node that starts finds whether the others
    are training (then it was restarted, and rejoins them): node 0's, or a coordinator's outside the nodes."""

    fits_in_this_process = 0  # the fits of the job this process took part in (a process that fitted never rejoins)

    def __init__(self, group: ReplicaGroup, timeout: timedelta) -> None:
        self.group = group
        self.store = register_client(group.first_store, timeout)
        host, port = group.first_store
        claim_or_check_run_id(self.store, launch_run_id(), f"the register at {url_host(host)}:{port}")
        # A process that fitted before is one of the job's own (a second fit); one that did not, started while the
        # others train, was restarted.
        self.joining = self.store.check([TRAINING_KEY]) and group.fit == 1
        if self.joining:
            self.fit = int(self.store.get(TRAINING_KEY).decode())
            FitRegister.fits_in_this_process = self.fit
        else:
            self.fit = group.fit
            self._wait_for_every_node()

    @classmethod
    def count_fit(cls) -> int:
        """Count a fit starting in this process (call on every rank, each fit): which fit of the job it is."""
        cls.fits_in_this_process += 1
        return cls.fits_in_this_process

    def _wait_for_every_node(self) -> None:
        """Return once every process of this fit that talks across nodes got here, so the first quorum holds every node
        (a late node would miss the weights made equal). Counted per fit: fits may differ in how many processes talk."""
        arrived = self.store.add(f"outer_sync/arrived/{self.fit}", 1)
        if arrived == self.group.num_nodes * self.group.members:
            self.store.set(f"outer_sync/everyone/{self.fit}", "")
        self.store.wait([f"outer_sync/everyone/{self.fit}"])

    def training_started(self) -> None:
        """Say in the store that the nodes train (node 0 does), once their weights are equal."""
        if self.group.node_rank == 0 and not self.joining:
            self.store.set(TRAINING_KEY, str(self.fit))

    def still_training(self) -> bool:
        """Whether the register still says that the nodes train: not once the fit was closed (:meth:`close`), nor
        once the register cannot be read (it went with node 0, whose store held it)."""
        try:
            return self.store.check([TRAINING_KEY])
        except RuntimeError:  # torch's store errors (DistNetworkError, DistStoreError) are RuntimeErrors
            return False

    def close(self, quorum_nodes: tuple[str, ...]) -> None:
        """The nodes no longer train, so a node that starts now starts a fit of its own: said by the first node of
        the latest quorum."""
        if is_first_node(quorum_nodes, self.group.node_rank) and self.group.local_rank == 0:
            self.store.delete_key(TRAINING_KEY)


class Membership:
    """Who each quorum holds, and one line when nodes left it or came back (reported once per node).

    Args:
        steps: returns the optimizer steps taken so far (the step the lines name).
        meeting: where a node that heartbeats but does not come in time was expected (``the sync``).
    """

    def __init__(
        self, option: str, num_nodes: int, steps: Callable[[], int], meeting: str, report: Callable[[str], None] | None
    ) -> None:
        self.option = option
        self.num_nodes = num_nodes
        self.steps = steps
        self.meeting = meeting
        self.report = report
        self.quorum_nodes: tuple[str, ...] = ()  # the nodes of the latest quorum
        self.joined: dict[str, int] = {}  # the nodes that came back, and at which step
        self.recovery_source: str | None = None  # the node this one healed from at the latest quorum, if it did
        self._replicas: tuple[str, ...] = ()  # the latest quorum's torchft replica ids (a restarted node has a new one)

    def watch(self, manager: Any) -> None:
        manager._client = _QuorumMembers(manager._client, self.note)

    def forget_quorum(self) -> None:
        """Take the next quorum as the first: the latest lacked nodes that had not been heard from yet."""
        self._replicas = ()

    def note(self, replicas: tuple[str, ...], source: str | None) -> None:
        """After each quorum (``replicas``: its members, ``node2:<uuid>`` each): report the nodes that left it and
        those that joined it since the previous one (``source``: the node this one heals from, if it does)."""
        before = self._replicas
        left = nodes_of(replica for replica in before if replica not in replicas)
        joined = nodes_of(replica for replica in replicas if before and replica not in before)
        lost = tuple(node for node in left if node not in joined)  # a node restarted in time is both: it came back
        self._replicas = replicas
        self.quorum_nodes = nodes_of(replicas)
        self.recovery_source = source
        step = self.steps()
        self.joined.update(dict.fromkeys(joined, step))
        if self.report is None:
            return
        training = f"{len(self.quorum_nodes)} of {self.num_nodes} nodes train on"
        if lost:
            self.report(
                f"{self.option}: {', '.join(lost)} left the job at step {step} (no heartbeat for 5 s, or not at "
                f"{self.meeting} within {LEFT_OUT_AFTER.seconds} s): {training}; the data the lost nodes read is not "
                "trained from here (docs/fault-tolerance.md)."
            )
        if joined:
            self.report(f"{self.option}: {', '.join(joined)} came back at step {step} (restarted): {training}.")


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
        self._note(tuple(quorum.replica_ids), nodes_of([source])[0] if source else None)
        return quorum


def nodes_of(replicas: Iterable[str]) -> tuple[str, ...]:
    """The nodes of torchft replica ids (``node2:<uuid>``: ``node2``), sorted."""
    return tuple(sorted(replica.split(":")[0] for replica in replicas))
