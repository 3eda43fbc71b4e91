"""torchft's servers in the processes of a job across nodes, each on the job's address and, where that address is not
a loopback one, behind a gate that passes on the job's machines only (``admission_gate.py``): the lighthouse (in
global rank 0, or in ``lightning-fastdist coordinator``) and each ``Manager``'s server (on its replica group's first
rank). torchft binds both to every interface by itself; one private torchft name is read to hold its ``Manager`` to
the server built here (``torchft_names.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from lightning_fastdist.parallel.across_nodes.admission_gate import AdmissionGate, admitted_by, is_loopback
from lightning_fastdist.parallel.across_nodes.group import (
    LEFT_OUT_AFTER,
    LIGHTHOUSE_KEY,
    ReplicaGroup,
    import_torchft,
    register_client,
)
from lightning_fastdist.parallel.faults.listeners import url_host


class Lighthouse:
    """torchft's lighthouse, started in this process, at ``port`` (0: a port of its own choosing) on ``address``:
    behind a gate that passes on the connections of the job's machines only where ``address`` is not a loopback one
    (``admission_gate.py``). Its URL goes into the register (``announce``), where the nodes read it.

    Once ``min_nodes`` asked, the lighthouse waits up to ``LEFT_OUT_AFTER`` for the other heartbeating groups
    (torchft's default, 100 ms, would split nodes a few milliseconds apart into different quorums).

    Args:
        register: a connection of this process's own to the job's register, where the gate reads who is admitted.
    """

    def __init__(
        self, address: str, min_nodes: int, owner: str, register: torch.distributed.Store, port: int = 0
    ) -> None:
        import_torchft(owner)
        from torchft.coordination import LighthouseServer

        gated = not is_loopback(address)
        join_timeout_ms = int(LEFT_OUT_AFTER.total_seconds() * 1000)
        bind = f"127.0.0.1:{port}" if gated else f"{url_host(address)}:{port}"
        self._server = LighthouseServer(bind=bind, min_replicas=min_nodes, join_timeout_ms=join_timeout_ms)
        self.port = int(self._server.address().rsplit(":", 1)[1])  # its URL names the hostname, not what it bound
        self.url = f"http://{url_host(address)}:{self.port}"
        self._gate = AdmissionGate(address, self.port, admitted_by(register), "the lighthouse") if gated else None

    def announce(self, register: torch.distributed.Store) -> None:
        """Put this lighthouse's URL into the register."""
        register.set(LIGHTHOUSE_KEY, self.url)

    def shutdown(self) -> None:
        if self._gate is not None:
            self._gate.shutdown()
        self._server.shutdown()


def new_manager(group: ReplicaGroup, timeout: timedelta, transport: Any, async_quorum: bool, owner: str) -> Any:
    """torchft's ``Manager`` for this process's replica group (``node2``), on gloo, sending a node that heals its
    state over ``transport``; with ``async_quorum`` a quorum overlaps the step's compute and a node that heals
    sits that step out. Its server (on the group's first rank) listens on the node's job address only, behind a gate
    where that is not a loopback address (``admission_gate.py``); ``manager.shutdown`` stops the gate too."""
    torchft = import_torchft(owner)
    with _manager_server_bound_to(group, timeout) as servers:
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=group.min_nodes,
            use_async_quorum=async_quorum,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=group.local_rank if group.sharded else 0,
            world_size=group.members,
            store_addr=group.store_host,
            store_port=group.store_port,
            lighthouse_addr=group.lighthouse,
            replica_id=f"node{group.node_rank}",
            init_sync=False,  # the weights are made equal by equalize_weights, through the public all-reduce
            checkpoint_transport=transport,
            hostname=group.store_host,  # the address its server announces to the lighthouse and the other nodes
        )
    if manager._manager is not None and manager._manager not in servers:
        raise RuntimeError(f"{owner}: torchft's Manager built its server another way than this torchft's did.")
    return manager


class _GatedManagerServer:
    """torchft's ``ManagerServer`` on loopback with a gate at its port on the job's address (what the ``Manager``
    holds, and shuts down: both stop)."""

    def __init__(self, server: Any, gate: AdmissionGate) -> None:
        self._server = server
        self._gate = gate

    def address(self) -> str:
        return self._server.address()

    def shutdown(self) -> None:
        self._gate.shutdown()
        self._server.shutdown()


@contextlib.contextmanager
def _manager_server_bound_to(group: ReplicaGroup, timeout: timedelta) -> Iterator[list[Any]]:
    """While torchft's ``Manager`` is built: its ``ManagerServer`` listens on the group's job address (the ``Manager``
    gives it ``[::]:PORT``), behind a gate where that is not a loopback address; the servers built are listed.
    torchft's module is as it was afterwards."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer
    built: list[Any] = []
    address = group.store_host

    def bound_server(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        if is_loopback(address):
            server = original(*args, bind=f"{url_host(address)}:{port}", **kwargs)
        else:
            inner = original(*args, bind=f"127.0.0.1:{port}", **kwargs)
            admitted = admitted_by(register_client(group.first_store, timeout))
            gate = AdmissionGate(address, int(inner.address().rsplit(":", 1)[1]), admitted, "a manager server")
            server = _GatedManagerServer(inner, gate)
        built.append(server)
        return server

    manager_module.ManagerServer = bound_server
    try:
        yield built
    finally:
        manager_module.ManagerServer = original
