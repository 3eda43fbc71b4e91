"""Watch ``torch.compile`` recompiles and report each cause once, with the fix that matches it.

A recompile silently costs a full compile, and after ``torch._dynamo.config.recompile_limit`` of them a function
falls back to eager. Torch would print every occurrence; :class:`RecompileWatcher` reports one line per function and
cause instead.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
# "- 0/1: tensor 'x' size mismatch ...  # source comment" -> "tensor 'x' size mismatch ..."
_GUARD_LINE = re.compile(r"^\s*-\s*(?:\d+/\d+:\s*)?(.*?)(?:\s+#.*)?$")
_FUNCTION = re.compile(r"Recompiling function (\S+)")


@dataclass(frozen=True)
class Cause:
    """Why a guard failed, in words, and what to change (or that nothing needs changing)."""

    what: str
    fix: str


# Checked in order against the failed guard; the first whose pattern matches names the cause.
CAUSES: tuple[tuple[re.Pattern[str], Cause], ...] = (
    (
        re.compile(r"cache_utils|past_key_value|\.layers\[\d+\]\.(?:is_initialized|keys|values)"),
        Cause(
            "HuggingFace's KV cache is passed through the blocks (each layer sees it in another state)",
            "set model.config.use_cache = False for training (the cache only speeds up generation)",
        ),
    ),
    (
        re.compile(r"check_type_id\((?:self|L\['self'\])|__func__\.__code__"),
        Cause("another block class runs the same compiled forward", "nothing: one compile per block class is expected"),
    ),
    (
        re.compile(r"grad_mode|requires_grad mismatch|dispatch key set mismatch"),
        Cause(
            "gradients were switched on or off (validation, test and predict run without them)",
            "nothing: one compile for training and one for evaluation are expected",
        ),
    ),
    (
        re.compile(r"\.training\b"),
        Cause("a module switched between train() and eval()", "nothing: one compile per mode is expected"),
    ),
    (
        re.compile(r"_parameters\[|Guard failed on a parameter|len\((?:self|fn\.__self__)\._modules"),
        Cause(
            "instances of one block class differ (parameter shapes or submodules)",
            "nothing for a few variants (one compile each); to compile once, name blocks whose instances match",
        ),
    ),
    (
        re.compile(r"size mismatch|stride mismatch"),
        Cause(
            "a tensor's shape changed (a new sequence length or batch size, or blocks of another width)",
            "set compile: {dynamic: true} if shapes vary on purpose, or keep them fixed "
            "(drop_last=True, pad to one length); blocks of several widths compile once per width",
        ),
    ),
    (
        re.compile(r"dtype mismatch"),
        Cause("a tensor's dtype changed between calls", "keep the inputs in one dtype (check precision and casts)"),
    ),
    (
        re.compile(r"device mismatch"),
        Cause("a tensor moved to another device between calls", "keep the inputs on the model's device"),
    ),
)
UNKNOWN_CAUSE = Cause("a guard failed", "run with TORCH_LOGS=recompiles to see every guard")
# Causes that a block class run at several places in the model explains at first (a shape, a missing argument).
_PLACE_GUARDS = re.compile(r"size mismatch|stride mismatch| is None|type\(|len\(L\['args'\]")


def call_site_cause(sites: dict[str, tuple[str, ...]]) -> Cause:
    """The cause of a recompile when compiled block classes run at several places (``sites``: class -> places)."""
    where = "; ".join(f"{cls} at {', '.join(places)}" for cls, places in sites.items())
    return Cause(
        f"one block class runs at several places in the model, each with inputs of its own shapes or arguments "
        f"({where}): each place needs a graph of its own",
        "nothing: one compile per place is expected; set compile: {dynamic: true} only if shapes also change "
        "from step to step",
    )


def explain_guard(guard: str) -> Cause:
    """The :class:`Cause` of a failed guard (``UNKNOWN_CAUSE`` when no pattern matches)."""
    for pattern, cause in CAUSES:
        if pattern.search(guard):
            return cause
    return UNKNOWN_CAUSE


def summarize_recompile(message: str) -> str:
    """One line from torch's recompile message: the function and the first failed guard."""
    function = _FUNCTION.search(message)
    guards = [m.group(1) for line in message.splitlines()[1:] if (m := _GUARD_LINE.match(line)) and m.group(1)]
    reason = guards[0] if guards else message.splitlines()[0]
    return f"{function.group(1) if function else 'a compiled function'}: {reason}"


class _Forward(logging.Handler):
    """The logging handler a watcher attaches while it runs (kept apart: a handler's lock cannot pickle)."""

    def __init__(self, watcher: RecompileWatcher) -> None:
        super().__init__(level=logging.DEBUG)
        self.watcher = watcher

    def emit(self, record: logging.LogRecord) -> None:
        self.watcher.record(record.getMessage())


class RecompileWatcher:
    """Count recompiles while started; report each function's distinct cause once. Picklable (a strategy keeps one).

    Args:
        report: gets a one-line message the first time a function recompiles for a cause (e.g. ``rank_zero_warn``).
    """

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = report
        # Compiled block classes run at several places (PreparedBlocks.compiled_call_sites); set by the strategy.
        self.call_sites: dict[str, tuple[str, ...]] = {}
        self.reasons: Counter[str] = Counter()
        self._reported: set[tuple[str, Cause]] = set()
        self._handler: _Forward | None = None
        self._propagate_before = True

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def start(self) -> None:
        """Attach to torch's recompile log (enabling it when torch logging is not user-configured)."""
        if self._handler is not None:
            return
        logger = logging.getLogger(RECOMPILES_LOGGER)
        self._propagate_before = logger.propagate
        if "TORCH_LOGS" not in os.environ:
            torch._logging.set_logs(recompiles=True)
            logger.propagate = False  # we report instead of torch's per-occurrence stderr lines
        self._handler = _Forward(self)
        logger.addHandler(self._handler)

    def stop(self) -> None:
        if self._handler is None:
            return
        logger = logging.getLogger(RECOMPILES_LOGGER)
        logger.removeHandler(self._handler)
        logger.propagate = self._propagate_before
        self._handler = None

    def record(self, message: str) -> None:
        """Count one recompile message from torch; report it if its function and cause are new."""
        summary = summarize_recompile(message)
        self.reasons[summary] += 1
        function, guard = summary.split(": ", 1)
        cause = explain_guard(guard)
        places = sum(len(found) for found in self.call_sites.values())
        # Each place may need a graph of its own (and its first block another, e.g. T5's relative position bias).
        if places > 0 and _PLACE_GUARDS.search(guard) and self._recompiles_of(function) <= 2 * places:
            cause = call_site_cause(self.call_sites)
        if (function, cause) in self._reported:
            return
        self._reported.add((function, cause))
        self.report(
            f"torch.compile recompiled {summary}. Cause: {cause.what}. Fix: {cause.fix}. "
            "(Reported once per function and cause.)"
        )

    def _recompiles_of(self, function: str) -> int:
        return sum(count for summary, count in self.reasons.items() if summary.startswith(f"{function}: "))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handler": None}
