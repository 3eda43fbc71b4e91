"""The ``timeout`` option of the strategies (how long a collective may wait before the process gives up), and the
line said when a collective gave up because another rank died or stopped answering.

A rank that dies (killed, out of memory, a lost node) leaves the others waiting in
their next collective. gloo notices a closed connection at once; a peer that is
alive but stuck (or a network that drops packets silently) is only noticed when
the process group's timeout expires. Lightning's default is 30 minutes; a job that
restarts itself (``torchrun --max-restarts``) wants a few minutes at most.

When a rank is killed, gloo fails the survivors' next collective at once
("Connection closed by peer"); when a rank is alive but stuck, the survivors'
collective fails once the process group's ``timeout`` expires ("Timed out
waiting ... for recv"). NCCL reports the same situations as a watchdog timeout or
an aborted communicator. Either way the survivor gets a ``RuntimeError`` from deep
inside torch; this module recognises those and puts one line in front of it that
names the cause and the way out, then the error propagates and the process exits
non-zero (under ``torchrun --max-restarts`` the job then restarts from its last
checkpoint).
"""

from __future__ import annotations

import logging
import math
import re
from datetime import timedelta

from torch.distributed.constants import default_pg_timeout  # what torch and Lightning use when nothing is set

log = logging.getLogger(__name__)


def collective_timeout(timeout: float | timedelta | None, owner: str) -> timedelta:
    """Return ``timeout`` as a ``timedelta``: a number is seconds (YAML-friendly), ``None`` is Lightning's default.

    Args:
        timeout: finite seconds (> 0), a ``timedelta`` (> 0), or ``None``.
        owner: the class name to put in the error message.

    Raises:
        ValueError: zero, negative, infinite, NaN, or not a number / timedelta.
    """
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(_message(owner, timeout))
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(_message(owner, timeout))
    return timedelta(seconds=seconds)


def _message(owner: str, timeout: object) -> str:
    return f"{owner}: timeout must be a finite number of seconds > 0 (or a timedelta), got {timeout!r}."


# Messages torch's backends give when a peer is gone (gloo, NCCL) or silent past the timeout.
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|Application timeout|"
    r"Watchdog caught collective operation timeout|NCCL communicator was aborted|"
    r"failed to recv, got 0 bytes|Socket Timeout|DistNetworkError",
    re.IGNORECASE,
)


def is_lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it was raised from) is a collective that lost or timed out on a peer."""
    seen: BaseException | None = exception
    while seen is not None:
        if _LOST_PEER.search(f"{type(seen).__name__}: {seen}"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def lost_peer_message(timeout: timedelta, rank: int) -> str:
    """The line printed in front of a lost-peer error on ``rank``."""
    return (
        f"[rank {rank}] training stopped: a collective failed because another rank died or did not answer "
        f"within the collective timeout ({timeout.total_seconds():g} s). Look at the other ranks' logs for the "
        "cause; resume with --ckpt_path last (torchrun --max-restarts does this by itself)."
    )


def explain_lost_peer(exception: BaseException, timeout: timedelta, rank: int) -> None:
    """If ``exception`` is a lost peer, log :func:`lost_peer_message` and attach it to the exception as a note.

    Args:
        exception: what interrupted training (from a strategy's ``on_exception``).
        timeout: the process group's collective timeout, quoted in the message.
        rank: this process's global rank.
    """
    if not is_lost_peer(exception):
        return
    message = lost_peer_message(timeout, rank)
    log.error(message)
    if hasattr(exception, "add_note"):  # Python >= 3.11 prints it under the traceback
        exception.add_note(message)
