"""How ``bench`` and ``tune`` end the training processes they started, whatever ends them: each child leads a session
of its own (its ranks, loader and compile workers in it), killed as a whole when the command stops early; and SIGTERM
ends the command as Ctrl-C does, so that the cleanup runs (its default action would leave every child running)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import IO

TERMINATED = 128 + signal.SIGTERM  # the exit status of a command ended by SIGTERM


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(TERMINATED)


@contextmanager
def sigterm_ends_the_command() -> Iterator[None]:
    """While inside: SIGTERM raises ``SystemExit(143)`` in the main thread, so every ``finally`` runs; the previous
    handler is put back after (a command called as a function leaves its caller's process as it found it)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_session(command: Sequence[str], log: IO, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """``command`` started as the leader of a session of its own (what it starts stays in it), its output in ``log``."""
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def end_session(process: subprocess.Popen) -> None:
    """Kill ``process``'s session, everything it started included, unless it has ended; wait for it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
