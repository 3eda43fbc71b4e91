"""Where the job's listeners bind: the address this machine uses on the route to the job's first node (or its
coordinator), never every interface. ``docs/security.md`` lists each listener.

torch.distributed treats the cluster network as trusted; a wildcard bind would also open every port to networks the
job never uses (a management or public interface). ``LIGHTNING_FASTDIST_BIND`` names the address instead (per node:
each node has its own), e.g. the address of the interface the nodes share.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

BIND_VARIABLE = "LIGHTNING_FASTDIST_BIND"


class PortInUseError(RuntimeError):
    """A listener of the job could not bind its address and port (another job holds it)."""


def job_address(peer: str, several_machines: bool = False) -> str:
    """This machine's address on the route to ``peer`` (a host name or address the job's processes reach: the first
    node, the coordinator); a loopback address where ``peer`` is this machine's loopback. ``LIGHTNING_FASTDIST_BIND``,
    where set, wins.

    Raises:
        ValueError: ``peer`` is a name that resolves to a loopback address here while the job spans
            ``several_machines`` (Debian maps a machine's own name to 127.0.1.1): the other machines could not reach a
            listener bound there.
    """
    chosen = os.environ.get(BIND_VARIABLE)
    if chosen:
        return chosen
    family, _, _, _, target = socket.getaddrinfo(peer, 1, type=socket.SOCK_DGRAM)[0]
    if several_machines and not _is_address(peer) and ipaddress.ip_address(target[0]).is_loopback:
        raise ValueError(
            f"{peer!r} resolves to {target[0]} (a loopback address) on this machine, where the job's other nodes "
            f"cannot reach it: give the address of {peer} on the network the nodes share (MASTER_ADDR, or "
            f"{BIND_VARIABLE} for this node)."
        )
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing: it only picks the route
        probe.connect(target)
        return probe.getsockname()[0]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def host_address(host: str | None = None) -> str:
    """The address ``host`` (this machine's name by default) resolves to: what a process that must announce one
    address and has no peer yet (the coordinator) binds."""
    return socket.getaddrinfo(host or socket.gethostname(), 1, type=socket.SOCK_STREAM)[0][4][0]


def url_host(address: str) -> str:
    """``address`` as a URL or ``HOST:PORT`` writes it (an IPv6 address in brackets)."""
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:  # a host name
        return address


def listening_socket(address: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to ``address:port`` (``port`` 0: any free one) and listening; ``what`` names it in the one
    line of a port another process holds."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError as error:
        listener.close()
        raise PortInUseError(
            f"{what} cannot listen on {url_host(address)}:{port}: {error.strerror or error}; probably another job "
            "holds it: give this job another port."
        ) from None
    listener.listen(1024)
    return listener


def bound_store(address: str, port: int, timeout: timedelta, what: str) -> dist.TCPStore:
    """A ``TCPStore`` server on ``address:port`` only (torch's own binds every interface), through an already bound
    socket (``master_listen_fd``); its port is ``store.port`` when ``port`` is 0."""
    listener = listening_socket(address, port, what)
    bound_port = listener.getsockname()[1]
    return dist.TCPStore(
        address,
        bound_port,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns it from here
    )
