"""The strategies' ``timeout`` option (how long a collective may wait), and the line said when a collective gave up
because another rank died or stopped answering. gloo notices a crashed peer at once and a stuck one only at the
timeout; NCCL's watchdog by default ends the process with no line of ours (``docs/fault-tolerance.md``,
"Timeouts and a rank that dies").
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from datetime import timedelta

from torch.distributed.constants import default_pg_timeout  # what torch and Lightning use when nothing is set

log = logging.getLogger(__name__)


def collective_timeout(timeout: float | timedelta | None, owner: str) -> timedelta:
    """Return ``timeout`` as a ``timedelta``: a number is seconds (YAML-friendly), ``None`` is Lightning's default.

    A value that is not finite and > 0 raises a ``ValueError`` naming ``owner``.
    """
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        seconds = math.nan  # not a duration: refused below
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{owner}: timeout must be a finite number of seconds > 0 (or a timedelta), got {timeout!r}.")
    return timedelta(seconds=seconds)


# What torch's backends say when a peer crashed (gloo's closed socket, NCCL's remote error) ...
_CRASHED = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|failed to recv, got 0 bytes|"
    r"remote process exited|ncclRemoteError",
    re.IGNORECASE,
)
# ... or stayed silent past the collective timeout ...
_TIMED_OUT = re.compile(r"Timed out waiting|Application timeout|Watchdog caught collective operation timeout|"
                        r"Socket Timeout", re.IGNORECASE)  # fmt: skip
# ... or NCCL's watchdog aborted the communicator (after one of the two: its own log line says which) ...
_ABORTED = re.compile(r"NCCL communicator was aborted", re.IGNORECASE)
# ... or the connection to the other ranks broke in a way that names neither.
_LOST = re.compile(r"DistNetworkError", re.IGNORECASE)
CAUSES = (("crashed", _CRASHED), ("timed out", _TIMED_OUT), ("aborted", _ABORTED), ("lost", _LOST))

NCCL_ERROR_HANDLING_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # new, deprecated
NCCL_DEFAULT_ERROR_HANDLING = 3  # torch's ProcessGroupNCCL default (SkipCleanUp)
NCCL_ERROR_HANDLING = {
    0: "no handling: a failed collective is not acted on, and a lost peer can hang the job",
    1: "abort the communicator, then end the process",
    2: "abort the communicator; the next collective raises in Python",
    3: "end the process at once (SIGABRT, no Python traceback: the watchdog's line is the last word)",
}


def lost_peer_cause(exception: BaseException) -> str | None:
    """``"crashed"``, ``"timed out"``, ``"aborted"`` or ``"lost"`` if ``exception`` (or one it was raised from) is a
    collective that lost a peer, else ``None``."""
    seen: BaseException | None = exception
    while seen is not None:
        text = f"{type(seen).__name__}: {seen}"
        for cause, pattern in CAUSES:
            if pattern.search(text):
                return cause
        seen = seen.__cause__ or seen.__context__
    return None


def nccl_error_handling(environ: Mapping[str, str] = os.environ) -> str:
    """What torch's NCCL watchdog does on a failed or timed-out collective, as ``"NAME=value (meaning)"``.

    Read as torch reads it: the new variable, else the deprecated one, else torch's default.
    """
    for name in NCCL_ERROR_HANDLING_VARIABLES:
        if name in environ:
            value = environ[name].strip()
            meaning = NCCL_ERROR_HANDLING.get(int(value)) if value.lstrip("-").isdigit() else None
            return f"{name}={value} ({meaning or 'a value torch does not document'})"
    return (
        f"{NCCL_ERROR_HANDLING_VARIABLES[0]} unset: torch's default {NCCL_DEFAULT_ERROR_HANDLING} "
        f"({NCCL_ERROR_HANDLING[NCCL_DEFAULT_ERROR_HANDLING]})"
    )


_RESUME = "resume with --ckpt_path last (torchrun --max-restarts does this by itself)."


def lost_peer_message(timeout: timedelta, rank: int, cause: str = "timed out", backend: str | None = None) -> str:
    """The line printed in front of a lost-peer error on ``rank``.

    ``timeout`` is quoted only when a peer timed out (or may have); under the ``"nccl"`` backend the watchdog's
    setting is named too.
    """
    seconds = f"{timeout.total_seconds():g} s"
    what = {
        "crashed": "another rank crashed or was killed (its connection closed; no collective timed out)",
        "timed out": f"another rank did not answer within the collective timeout ({seconds}): it is stuck, or "
        "slower than the timeout allows",
        "aborted": "NCCL's watchdog aborted the communicator after a collective failed (a crashed peer) or ran "
        f"past the collective timeout ({seconds}); its own line above says which",
        "lost": "the connection to another rank broke (it crashed, or the network failed)",
    }[cause]
    watchdog = f" NCCL's watchdog: {nccl_error_handling()}." if backend == "nccl" else ""
    return (
        f"[rank {rank}] training stopped: a collective failed because {what}.{watchdog} Look at the other ranks' "
        f"logs for the cause; {_RESUME}"
    )


def explain_lost_peer(exception: BaseException, timeout: timedelta, rank: int, backend: str | None = None) -> None:
    """If ``exception`` (from a strategy's ``on_exception``) is a lost peer, log :func:`lost_peer_message` and attach
    it to the exception as a note."""
    cause = lost_peer_cause(exception)
    if cause is None:
        return
    message = lost_peer_message(timeout, rank, cause, backend)
    log.error(message)
    if hasattr(exception, "add_note"):  # Python >= 3.11 prints it under the traceback
        exception.add_note(message)


def explained_lost_peer(exception: BaseException) -> str | None:
    """The line :func:`explain_lost_peer` logged for ``exception`` and attached to it, or ``None`` if it did not."""
    notes = getattr(exception, "__notes__", ())
    return next((note for note in notes if note.startswith("[rank ") and " training stopped: " in note), None)
