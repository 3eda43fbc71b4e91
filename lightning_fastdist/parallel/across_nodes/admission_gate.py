"""A gate in front of torchft's servers that check no identity: it passes on the connections of the job's machines
and closes any other before reading a byte.

torchft's lighthouse serves, on its port, a dashboard whose ``POST /replica/<id>/kill`` ends that node at once (it
asks the node's manager server, which takes the same request from anyone). So each of them listens on loopback, at a
port of its own choosing, and a gate listens at the same port on the node's job address: a connection from an address
the job's register lists (each node adds its own once the register accepted its run id: :func:`admit`) or from this
machine is joined to the server, byte for byte in both directions. The server keeps announcing its own port with the
job address, which is where the gate is. Processes on a machine of the job are trusted, as torch.distributed trusts
them (``docs/security.md``).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable

import torch.distributed as dist

from lightning_fastdist.parallel.faults.listeners import listening_socket

ADDRESS_KEY_PREFIX = "job_address/"  # in the register: one key per address of the job's machines
_CHUNK = 1 << 16


def admit(register: dist.Store, address: str) -> None:
    """Say in the job's register that connections from ``address`` (a machine of the job) may pass its gates."""
    register.set(f"{ADDRESS_KEY_PREFIX}{address}", "")


def admitted_by(register: dist.Store) -> Callable[[str], bool]:
    """Whether a peer address is a machine of the job, by the register's keys (read at each new connection; give the
    gate a connection of its own: it reads from its thread)."""

    def is_admitted(address: str) -> bool:
        return register.check([f"{ADDRESS_KEY_PREFIX}{address}"])

    return is_admitted


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.strip("[]")).is_loopback


class AdmissionGate:
    """Listens at ``address:port`` and joins each admitted connection to the server at ``127.0.0.1:port``."""

    def __init__(self, address: str, port: int, is_admitted: Callable[[str], bool], what: str) -> None:
        self._port = port
        self._is_admitted = is_admitted
        self._own = {ipaddress.ip_address(address.strip("[]"))}
        self._listener = listening_socket(address, port, f"the gate of {what}")
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"gate-{port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                peer, (peer_address, *_) = self._listener.accept()
            except OSError:  # closed by shutdown
                return
            if not self._passes(peer_address):
                peer.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self._port))
            except OSError:
                peer.close()
                continue
            with self._lock:
                self._open |= {peer, server}
            for source, sink in ((peer, server), (server, peer)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _passes(self, peer_address: str) -> bool:
        peer = ipaddress.ip_address(peer_address.split("%")[0])
        if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
            peer = peer.ipv4_mapped
        return peer in self._own or peer.is_loopback or self._is_admitted(str(peer))

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy ``source`` to ``sink`` until either end closes, then close both."""
        try:
            while chunk := source.recv(_CHUNK):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {source, sink}
            for end in (source, sink):
                end.close()

    def shutdown(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone may not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for end in self._open:
                end.close()
            self._open.clear()
