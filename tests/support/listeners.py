"""The TCP ports a set of processes (and every process they started) listen on, as ``ss -ltnp`` shows them: what
``docs/security.md`` promises about the job's listeners is read from the kernel, not from our code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_OWNER = re.compile(r"pid=(\d+)")
WILDCARDS = ("0.0.0.0", "[::]", "*", "[::ffff:0.0.0.0]")


def descendants(pids: list[int]) -> set[int]:
    """``pids`` and every process started under them (their threads' children, recursively)."""
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # it ended meanwhile
                continue
    return found


def listening_addresses(pids: list[int]) -> list[str]:
    """``ADDRESS:PORT`` of each TCP socket listening in a process of ``pids`` or under them."""
    owners = descendants(pids)
    shown = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [
        line.split()[3]
        for line in shown.splitlines()
        if line.strip() and {int(pid) for pid in _OWNER.findall(line)} & owners
    ]


def on_a_wildcard(addresses: list[str]) -> list[str]:
    """Those of ``addresses`` that listen on every interface."""
    return [address for address in addresses if address.rsplit(":", 1)[0] in WILDCARDS]
