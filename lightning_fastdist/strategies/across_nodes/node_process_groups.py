"""One torch.distributed world per node, for the strategies whose nodes train as torchft replica groups (``outer_sync``,
``replica_groups``).

A node's ranks rendezvous in a store of their node at ``MASTER_PORT + 1 + NODE_RANK`` (``MASTER_PORT`` stays a
launcher's: torchrun's agent listens there); node 0's is the register where the
nodes meet. Global rank 0 starts torchft's lighthouse at a port of its own choosing and puts its URL into the register,
unless ``TORCHFT_LIGHTHOUSE`` names one, or a coordinator outside the nodes holds both
(``LIGHTNING_FASTDIST_COORDINATOR``), so that losing node 0 does not end the job. Every listener binds this node's
address on the route to node 0 (``listeners.job_address``), and every store is claimed for the job's run id, so another
job given overlapping ports is refused in one line (``docs/security.md``). Lightning keeps the job's global ranks and
world size; its own collectives are within the node.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy

from lightning_fastdist.parallel.across_nodes.admission_gate import admit
from lightning_fastdist.parallel.across_nodes.group import (
    COORDINATOR_VARIABLE,
    FitRegister,
    ReplicaGroup,
    coordinator_at,
    import_torchft,
    lighthouse_in,
    register_client,
    transport_token_in,
)
from lightning_fastdist.parallel.across_nodes.torchft_servers import Lighthouse
from lightning_fastdist.parallel.faults.job_identity import claim_or_check_run_id, launch_run_id
from lightning_fastdist.parallel.faults.listeners import bound_store, job_address, url_host

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"  # torchft's own: a lighthouse the job should use instead of starting one


class NodeProcessGroups:
    """The node's own torch.distributed world (its process group and store) and, on global rank 0, the lighthouse.

    Args:
        owner: the strategy, as errors name it; ``option``: its option (``outer_sync``).
        min_nodes: the fewest nodes the job trains on (``None``: every node).
        sharded: each rank of a node holds a shard of the weights (FSDP) instead of all of them.
    """

    lighthouse_ports: ClassVar[dict[str, int]] = {}  # by address: the port this process's lighthouses take

    def __init__(self, owner: str, option: str, min_nodes: int | None, sharded: bool) -> None:
        self.owner = owner
        self.option = option
        self.min_nodes = min_nodes
        self.sharded = sharded
        self.group: ReplicaGroup | None = None  # once joined
        self.store: dist.Store | None = None  # the node's own store, shared by its ranks
        self._lighthouse: Lighthouse | None = None
        self._manager_store: dist.TCPStore | None = None  # this fit's, on local rank 0

    def check_can_start(self) -> None:
        """Refuse, before any process starts, a job without torchft or with a coordinator address that is not one."""
        import_torchft(f"{self.owner}'s {self.option}")
        coordinator = os.environ.get(COORDINATOR_VARIABLE)
        if coordinator is not None:
            coordinator_at(coordinator)  # a bad address is refused before any process starts

    def join(self, strategy: ParallelStrategy, backend: str, timeout: timedelta) -> None:
        """Join this node's own world (and on global rank 0 start the lighthouse), after the strategy set its ranks."""
        environment = strategy.cluster_environment
        assert environment is not None and strategy.accelerator is not None
        strategy.accelerator.setup_device(strategy.root_device)
        main_port = environment.main_port
        first_store = (environment.main_address, main_port + 1)  # node 0's own
        coordinator = os.environ.get(COORDINATOR_VARIABLE)
        if coordinator is not None:
            first_store = coordinator_at(coordinator)
        address = job_address(first_store[0], several_machines=strategy.num_nodes > 1)
        store_port = main_port + 1 + strategy.node_rank
        node_store = None
        if strategy.local_rank == 0 and not dist.is_initialized():  # a second fit keeps the node's world
            node_store = bound_store(address, store_port, timeout, f"node{strategy.node_rank}'s store")
        hosts_register = node_store is not None and strategy.node_rank == 0 and coordinator is None
        register = node_store if hosts_register else register_client(first_store, timeout)
        claim_or_check_run_id(register, launch_run_id(), f"the register at {url_host(first_store[0])}:{first_store[1]}")
        admit(register, address)  # this machine's connections pass the lighthouse's gate
        if strategy.global_rank == 0 and LIGHTHOUSE_VARIABLE not in os.environ and coordinator is None:
            # Once per fit (torchft's quorum numbers start again with a new lighthouse), on the port of this process's
            # first: a node that reads the register before this fit's lighthouse announced itself finds its URL.
            gate_register = register_client(first_store, timeout)  # its own connection: the gate reads it in a thread
            min_nodes = self.min_nodes or strategy.num_nodes
            port = NodeProcessGroups.lighthouse_ports.get(address, 0)
            self._lighthouse = Lighthouse(address, min_nodes, self.option, gate_register, port)
            NodeProcessGroups.lighthouse_ports[address] = self._lighthouse.port
            self._lighthouse.announce(register)
        lighthouse = os.environ.get(LIGHTHOUSE_VARIABLE) or lighthouse_in(register)
        self.group = ReplicaGroup(
            node_rank=strategy.node_rank,
            num_nodes=strategy.num_nodes,
            local_rank=strategy.local_rank,
            sharded=self.sharded,
            ranks_per_node=strategy.num_processes,
            min_nodes=self.min_nodes or strategy.num_nodes,
            store_host=address,
            store_port=store_port,
            lighthouse=lighthouse,
            first_store=first_store,
            transport_token=transport_token_in(register),
        )
        if dist.is_initialized():
            return
        store = node_store or dist.TCPStore(address, store_port, is_master=False, timeout=timeout)
        claim_or_check_run_id(
            store, launch_run_id(), f"node{strategy.node_rank}'s store at {url_host(address)}:{store_port}"
        )
        self.store = dist.PrefixStore("outer_sync", store)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("default_pg", store),
            rank=strategy.local_rank,
            world_size=strategy.num_processes,
            timeout=timeout,
        )

    def group_of_this_fit(self) -> ReplicaGroup:
        """This node's group with a store of this fit's own for torchft's ``Manager``: torchft keys each quorum's
        rendezvous by a number a new lighthouse counts from 1 again, so a second fit sharing a store would read the
        first one's addresses. Call on every rank of the node when a fit starts."""
        group = self.group
        assert group is not None, "join first"
        self.close_fit()
        port = None
        if group.local_rank == 0:
            self._manager_store = bound_store(group.store_host, 0, timedelta(minutes=5), "the fit's torchft store")
            port = self._manager_store.port
        if self.sharded:  # every rank of the node runs a Manager of the same replica group
            port = share_in_node(port)
        return dataclasses.replace(group, store_port=port or group.store_port, fit=FitRegister.count_fit())

    def close_fit(self) -> None:
        """Stop this fit's store (its Managers are shut down)."""
        self._manager_store = None

    def stop_lighthouse(self) -> None:
        """Stop the lighthouse, where this process started it."""
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None


def broadcast_in_node(tensors: Iterable[torch.Tensor]) -> None:
    """Give the node's other ranks local rank 0's values of ``tensors`` (a collective of the node's world)."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def decide_in_node(
    decision: bool,
    all: bool,  # noqa: A002 - Lightning's name
    device: torch.device,
    across_nodes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> bool:
    """Lightning's ``reduce_boolean_decision`` over the node's ranks (and those of every node, where ``across_nodes``
    sums the node's counts over them): every rank counted decided yes (``all``), or one did. Lightning's own compares
    the count with the job's world size, which a world per node never reaches (ModelCheckpoint would save no top-k
    checkpoint)."""
    counts = torch.tensor([int(decision), 1], device=device)  # [ranks that decided yes, ranks]
    if dist.get_world_size() > 1:
        dist.all_reduce(counts)
    if across_nodes is not None:
        counts = across_nodes(counts)
    yes, ranks = counts.tolist()
    return yes == ranks if all else yes > 0


def share_in_node(value: Any) -> Any:
    """Local rank 0's ``value`` on every rank of the node (a collective of the node's world)."""
    if dist.get_world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
