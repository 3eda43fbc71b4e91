"""Faults a test or a benchmark injects into one node's fit, set by environment variables so that a recipe run
through the CLI takes them too (``--trainer.callbacks+=tests.support.node_faults.NodeFaults``, with the repository
on ``PYTHONPATH``):

- ``NODE_FAULT_SIGTERM_AT=S``: every rank sends itself SIGTERM during step ``S`` (a job preempted);
- ``NODE_FAULT_KILL=N:S``: every rank of node ``N`` prints ``KILLED N S <time>`` and SIGKILLs itself after step ``S``
  (a node lost), or sends itself ``NODE_FAULT_KILL_SIGNAL`` (``SIGTERM``: a node preempted); with
  ``NODE_FAULT_KILL_IN=backward``, at the end of step ``S``'s backward instead: under ``replica_groups`` once the
  step's quorum holds the node and before its gradients cross the link (the others' all-reduce of that step fails);
- ``NODE_FAULT_HOLD=S:FILE``: the other nodes write ``FILE.held`` after step ``S`` and wait until ``FILE`` exists, and
  ``NODE_FAULT_ANNOUNCE=FILE``: a node writes ``FILE`` when its training starts (``NODE_FAULT_HOLD_GRACE=SECONDS``:
  the others hold that much longer, for its first quorum request to reach the lighthouse before theirs). Together: a
  node restarted after the others held joins them before their run ends (with the grace: on a loaded machine too).

Put it before callbacks that record a step, so that they record no step of a node killed after it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L


class NodeFaults(L.Callback):
    """The faults the environment variables of this module's docstring ask for."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        announce = os.environ.get("NODE_FAULT_ANNOUNCE")
        if announce:
            open(announce, "w").close()

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if os.environ.get("NODE_FAULT_KILL_IN") == "backward":
            run = getattr(getattr(trainer.strategy, "across_nodes", None), "run", None)
            if run is not None:
                run.manager.wait_quorum()  # the step's quorum holds this node
            self._kill_if_due(trainer, trainer.global_step + 1)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        step = trainer.global_step
        if step == int(os.environ.get("NODE_FAULT_SIGTERM_AT", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
        if os.environ.get("NODE_FAULT_KILL_IN") != "backward":
            self._kill_if_due(trainer, step)
        killed_node = os.environ.get("NODE_FAULT_KILL", "-1:0").partition(":")[0]
        hold_step, _, hold_file = os.environ.get("NODE_FAULT_HOLD", "0:").partition(":")
        if step == int(hold_step) and trainer.node_rank != int(killed_node):
            open(f"{hold_file}.held", "w").close()
            while not os.path.exists(hold_file):
                time.sleep(0.1)
            time.sleep(float(os.environ.get("NODE_FAULT_HOLD_GRACE", "0")))

    def _kill_if_due(self, trainer: L.Trainer, step: int) -> None:
        killed_node, _, kill_step = os.environ.get("NODE_FAULT_KILL", "-1:0").partition(":")
        if (trainer.node_rank, step) == (int(killed_node), int(kill_step)):
            print("KILLED", trainer.node_rank, step, time.time(), flush=True)
            os.kill(os.getpid(), signal.Signals[os.environ.get("NODE_FAULT_KILL_SIGNAL", "SIGKILL")])


def wait_until_held(started: Path, timeout: float = 240) -> None:
    """Return once the other nodes hold (``NODE_FAULT_HOLD=S:started`` wrote ``started.held``), or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not Path(f"{started}.held").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def start_again_once_held(
    killed: subprocess.Popen,
    command: list[str],
    environment: dict[str, str],
    started: Path,
    timeout: float = 240,
    start: Callable[[list[str], dict[str, str]], Any] | None = None,
) -> Any:
    """Wait until the node ``killed`` ended (``NODE_FAULT_KILL``: SIGKILLed, or stopped by SIGTERM with exit status
    143) and the others hold (``NODE_FAULT_HOLD=S:started``), then start it again with the same ``command`` and
    ``environment``, without the kill and announcing itself (``NODE_FAULT_ANNOUNCE``): by ``start(command, its whole
    environment)`` where given (as the test started the others), else with its output piped, as text."""
    ended = killed.wait(timeout=timeout)
    expected = 128 + signal.SIGTERM if environment.get("NODE_FAULT_KILL_SIGNAL") == "SIGTERM" else -signal.SIGKILL
    assert ended == expected, killed.stderr.read()[-3000:] if killed.stderr else ended
    wait_until_held(started, timeout)
    again = {name: value for name, value in environment.items() if name != "NODE_FAULT_KILL"}
    again = {**os.environ, **again, "NODE_FAULT_ANNOUNCE": str(started)}
    if start is not None:
        return start(command, again)
    return subprocess.Popen(
        command,
        env=again,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_time(output: str) -> float | None:
    """When the node whose stdout is ``output`` killed itself (its ``KILLED`` line), if it did."""
    killed = re.search(r"^KILLED \d+ \d+ ([0-9.]+)$", output, re.MULTILINE)
    return float(killed.group(1)) if killed else None


def samples_read_twice(reports: list[dict]) -> int:
    """Training samples two nodes read in the same epoch (each report's ``samples``: per step the epoch and the
    sample indices read)."""
    read = [{(epoch, index) for epoch, indices in report["samples"] for index in indices} for report in reports]
    return sum(len(read[i] & read[j]) for i in range(len(read)) for j in range(i + 1, len(read)))
