"""How a live node sends its state to a node that heals: torchft's checkpoint transport interface, over HTTP on this
node's job address, to the job's processes only, and read without unpickling.

torchft's own ``HTTPTransport`` listens on every interface, serves the state to any request for the current step, and
loads what it receives with ``weights_only=False``: a process that registers as a replica and becomes the recovery
source could run code on the healing node. Here the server binds this node's address on the route to the others, each
request must name the job's token (from the register: ``group.transport_token``), and the healing node loads the
bytes with ``torch.load(weights_only=True)``: tensors, containers and numbers, nothing that runs
(``docs/security.md``).
"""

from __future__ import annotations

import hmac
import io
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lightning_fastdist.parallel.across_nodes.rejoin import tensor_bytes_of
from lightning_fastdist.parallel.faults.listeners import listening_socket, url_host


class NodeStateTransport:
    """Serves this process's state for one step at a time, and receives a peer's (torchft's ``CheckpointTransport``).

    Args:
        address: this node's address on the route to the others; the server listens there only.
        token: the job's; a request that does not name it receives nothing.
        timeout: how long a request waits for the state of its step, and a receive for its bytes.

    Attributes:
        received_bytes: the tensor bytes of every state received.
        refused: requests refused (without the job's token, or for another step).
    """

    def __init__(self, address: str, token: str, timeout: timedelta) -> None:
        self._token = token
        self._request_timeout = timeout
        self._served = threading.Condition()
        self._step: int | None = None
        self._payload: bytes | None = None
        self.received_bytes = 0
        self.refused = 0
        listener = listening_socket(address, 0, "the node's state transport")
        self._server = _Server(listener, self)
        self._url = f"http://{url_host(address)}:{listener.getsockname()[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="node-state-transport", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        """Where a peer fetches from (the token is not in it: torchft hands this to any process that asks)."""
        return self._url

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serve ``state_dict`` for ``step`` until :meth:`disallow_checkpoint` (tensors on the CPU, serialized once)."""
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        with self._served:
            self._step, self._payload = step, buffer.getvalue()
            self._served.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving: the state may change from here."""
        with self._served:
            self._step, self._payload = None, None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """The state a peer serves for ``step`` at ``metadata``, loaded weights-only."""
        request = urllib.request.Request(f"{metadata}{step}", headers={"Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
            payload = response.read()
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        self.received_bytes += tensor_bytes_of(state)
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    def payload_for(self, token: str, step: str) -> bytes | None:
        """What a request naming ``token`` and ``step`` receives: the state of that step once served, or ``None``
        (another token, another step, or none served within the timeout)."""
        if not hmac.compare_digest(token.encode(), self._token.encode()) or not step.isdigit():
            self.refused += 1
            return None
        with self._served:
            self._served.wait_for(lambda: self._step is not None, timeout=self._request_timeout.total_seconds())
            if self._step != int(step):
                self.refused += 1
                return None
            return self._payload


class _Server(ThreadingHTTPServer):
    """An HTTP server on an already bound socket, answering ``GET /STEP`` for its transport."""

    daemon_threads = True

    def __init__(self, listener: Any, transport: NodeStateTransport) -> None:
        self.transport = transport
        super().__init__(listener.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made: the listener is bound already
        self.socket = listener
        self.server_name, self.server_port = str(listener.getsockname()[0]), listener.getsockname()[1]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        payload = self.server.transport.payload_for(token if scheme == "Bearer" else "", self.path.strip("/"))
        if payload is None:
            self.send_error(403)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        """Quiet: a refused request is counted (``refused``), not printed on every rank's stderr."""
