"""Watch ``torch.compile`` recompiles and report each distinct reason once.

A recompile (a new sequence length, a new dtype, a Python value that changed)
silently costs a full compile. torch writes each one, with the guard that
failed, to its ``recompiles`` log artifact; :class:`RecompileWatcher` switches
that artifact on (unless the user already configures torch logging through
``TORCH_LOGS``), counts the records, and passes each distinct reason to
``report`` once instead of letting torch print every occurrence.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable

import torch

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
# "- 0/1: tensor 'x' size mismatch ..." -> "tensor 'x' size mismatch ..."
_GUARD_LINE = re.compile(r"^\s*-\s*(?:\d+/\d+:\s*)?(.*)$")
_FUNCTION = re.compile(r"Recompiling function (\S+)")


def summarize_recompile(message: str) -> str:
    """One line from torch's recompile message: the function and the first failed guard."""
    function = _FUNCTION.search(message)
    guards = [m.group(1) for line in message.splitlines()[1:] if (m := _GUARD_LINE.match(line)) and m.group(1)]
    reason = guards[0] if guards else message.splitlines()[0]
    return f"{function.group(1) if function else 'a compiled function'}: {reason}"


class RecompileWatcher(logging.Handler):
    """Count recompiles while attached; report each distinct summary once.

    Args:
        report: called with a one-line message the first time each distinct
            recompile reason is seen (for example ``rank_zero_warn``).
    """

    def __init__(self, report: Callable[[str], None]) -> None:
        super().__init__(level=logging.DEBUG)
        self.report = report
        self.reasons: Counter[str] = Counter()
        self._logger = logging.getLogger(RECOMPILES_LOGGER)
        self._propagate_before = self._logger.propagate

    @property
    def count(self) -> int:
        """Recompiles seen so far."""
        return sum(self.reasons.values())

    def start(self) -> None:
        """Attach to torch's recompile log (enabling it when torch logging is not user-configured)."""
        self._propagate_before = self._logger.propagate
        if "TORCH_LOGS" not in os.environ:
            torch._logging.set_logs(recompiles=True)
            self._logger.propagate = False  # we report instead of torch's per-occurrence stderr lines
        self._logger.addHandler(self)

    def stop(self) -> None:
        """Detach from torch's recompile log."""
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate_before

    def emit(self, record: logging.LogRecord) -> None:
        summary = summarize_recompile(record.getMessage())
        self.reasons[summary] += 1
        if self.reasons[summary] == 1:
            self.report(
                f"torch.compile recompiled {summary}. Each distinct reason is reported once; "
                "if shapes vary on purpose, set compile: {dynamic: true}."
            )
