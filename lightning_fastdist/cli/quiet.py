"""Output of a ``lightning-fastdist`` run that says nothing about the user's run, hidden; with ``QUIET_VARIABLE``
set (not ``0``) Lightning's informational lines too, leaving the progress bar and the final numbers."""

from __future__ import annotations

import logging
import os
import warnings

QUIET_VARIABLE = "LIGHTNING_FASTDIST_QUIET"


class _DropTip(logging.Filter):
    """Drops Lightning's advertisement for its cloud logger, printed on every run without one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")


def silence_known_noise(resuming: bool) -> None:
    """Hide output that says nothing about the user's run; with ``QUIET_VARIABLE`` also Lightning's info lines."""
    # Lightning calls a pytree API that newer torch deprecates, once per rank.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    if resuming:  # the recipes' fixed checkpoint folder holds the checkpoints being resumed from, as it should
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(known, _DropTip) for known in lightning_info.filters):
        lightning_info.addFilter(_DropTip())
    if os.environ.get(QUIET_VARIABLE, "") not in ("", "0"):
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
