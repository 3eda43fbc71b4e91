"""A stranger on the job's network (a namespace on the emulated cluster's bridge that runs no node) tries each
endpoint it finds: what a node would lose (killed, or its state read) if our listeners trusted whoever reaches them.

``python -m tests.support.stranger ADDRESS:PORT ...`` prints one JSON line per endpoint: what plain HTTP requests
received (a listing, then the dashboard's kill of every replica the listing names; a node's state), as the status line
and the bytes of the body, or how the connection ended.
"""

from __future__ import annotations

import json
import re
import socket
import sys

REQUESTS = [
    "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # the lighthouse's dashboard lists the replicas
    "GET /3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # a node's state, at the step a node holds at
]
WAIT_S = 2  # for an answer: a server that keeps the connection open without answering (a store, gloo) answers none


def _exchange(address: str, port: int, request: str) -> dict:
    try:
        with socket.create_connection((address, port), timeout=WAIT_S) as connection:
            connection.sendall(request.encode())
            received = b""
            while chunk := connection.recv(1 << 16):
                received += chunk
    except OSError as error:
        return {"ended": type(error).__name__, "bytes": 0, "status": None}
    status = received.split(b"\r\n", 1)[0].decode(errors="replace") if received.startswith(b"HTTP/") else None
    return {"ended": "closed", "bytes": len(received), "status": status, "body": received[-2000:].decode("latin-1")}


def probe(endpoint: str) -> dict:
    address, _, port = endpoint.rpartition(":")
    answers = [_exchange(address.strip("[]"), int(port), request) for request in REQUESTS]
    listing = answers[0].get("body", "")
    kills = []
    for replica in sorted(set(re.findall(r"node\d+:[0-9a-f-]{36}", listing))):  # what the dashboard named
        kill = f"POST /replica/{replica}/kill HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        kills.append(_exchange(address.strip("[]"), int(port), kill))
    ok = [answer for answer in answers + kills if (answer["status"] or "").split(" ")[1:2] == ["200"]]
    return {"endpoint": endpoint, "answered_200": len(ok), "largest_answer": max(a["bytes"] for a in answers),
            "replicas_named": len(kills), "kills_answered": [k["status"] for k in kills]}  # fmt: skip


if __name__ == "__main__":
    for endpoint in sys.argv[1:]:
        print(json.dumps(probe(endpoint)), flush=True)
