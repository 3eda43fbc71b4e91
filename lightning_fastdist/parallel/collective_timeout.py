"""The ``timeout`` option of the strategies: how long a collective may wait before the process gives up.

A rank that dies (killed, out of memory, a lost node) leaves the others waiting in
their next collective. gloo notices a closed connection at once; a peer that is
alive but stuck (or a network that drops packets silently) is only noticed when
the process group's timeout expires. Lightning's default is 30 minutes; a job that
restarts itself (``torchrun --max-restarts``) wants a few minutes at most.
"""

from __future__ import annotations

import math
from datetime import timedelta

from torch.distributed.constants import default_pg_timeout  # what torch and Lightning use when nothing is set


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
