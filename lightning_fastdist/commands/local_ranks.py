"""Start every rank of a one-node run at once, with the variables ``torchrun`` sets.

Lightning starts the other ranks only once rank 0 has imported everything and built its Trainer: two start-ups in a
row for every setup ``bench`` and ``tune`` train. The ranks share a fresh run id, so our strategies refuse to mix
them with another job's ranks on the same port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import IO

from lightning_fastdist.commands.stopping import end_session, start_session
from lightning_fastdist.parallel.faults.job_identity import OWN_RUN_ID_VARIABLE, new_run_id

# Seconds the other ranks get to exit by themselves (and print why) once one rank failed, before they are killed:
# a rank waiting in a collective for a peer that died would otherwise wait for the whole collective timeout.
FAILURE_GRACE_S = 10.0
POLL_S = 0.1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """What ``torchrun`` sets for one rank of a single-node run, and the launch's run id."""
    return {
        OWN_RUN_ID_VARIABLE: run_id,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
    }


def run_local_ranks(command: Sequence[str], world_size: int, log: IO) -> int:
    """Run ``command`` as ``world_size`` ranks on this machine, all writing to ``log``; the first non-zero exit
    status of a rank, or 0 when every rank succeeded."""
    port, run_id = free_port(), new_run_id()
    processes = [
        start_session(command, log, {**os.environ, **rank_environment(rank, world_size, port, run_id)})
        for rank in range(world_size)
    ]  # this process's environment is unchanged
    try:
        return _wait_for_all(processes)
    finally:
        for process in processes:  # only after an interrupt or a failed rank's grace: the others are done
            end_session(process)


def _wait_for_all(processes: list[subprocess.Popen]) -> int:
    failed_since = None
    while True:
        codes = [process.poll() for process in processes]
        failures = [code for code in codes if code not in (None, 0)]
        if None not in codes or (failed_since is not None and time.monotonic() - failed_since > FAILURE_GRACE_S):
            return failures[0] if failures else 0
        if failures and failed_since is None:
            failed_since = time.monotonic()
        time.sleep(POLL_S)
