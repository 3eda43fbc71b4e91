"""Say clearly that training stopped because another rank died or stopped answering.

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
import re
from datetime import timedelta

log = logging.getLogger(__name__)

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
