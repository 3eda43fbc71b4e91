"""The private Lightning internals that the sync-free callbacks rely on, checked in one place.

Lightning has no public hook for "hand the loggers their values" or "check for
SIGTERM before a batch", so :class:`SyncFreeLogging`, :class:`SpeedMonitor` and
:class:`~lightning_fastdist.trainer.preemption.PreemptionHandler` replace a few
private methods *on one trainer's instances* (never on the classes) for the duration
of a fit; the strategies' ``comm/`` metrics read whether a batch is a logging step
(:class:`~lightning_fastdist.strategies.comm_metrics.CommBytesLogging`). Each is listed
here with the versions it was verified on; :func:`require_internals` fails in one line
naming the missing piece if an upgrade moved one (the optional preemption path only switches itself off,
saying so: :func:`missing_internals_line`), and ``tests/callbacks/test_sync_free_logging.py``
fails on the same check when the installed Lightning changes.
"""

from __future__ import annotations

import inspect

import lightning
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from packaging.version import Version

# Lightning versions whose internals were read and tested (lower bound inclusive, upper exclusive).
TESTED_LIGHTNING = (Version("2.6.0"), Version("2.7.0"))

# (object path from the trainer, attribute, the parameters it must take, what we use it for)
INTERNALS = (
    ("_logger_connector", "log_metrics", ("metrics", "step"), "hand host-side values to the loggers"),
    ("_logger_connector", "metrics", None, "read this batch's metrics without converting them"),
    ("_logger_connector", "should_update_logs", None, "know whether this batch is a logging step"),
    ("_logger_connector", "_progress_bar_metrics", None, "show the last transferred values in the progress bar"),
    ("_signal_connector", "register_signal_handlers", (), "record SIGTERM/SIGUSR1 without a collective"),
    ("_signal_connector", "_register_signal", ("signum", "handlers"), "install the signal handlers"),
    ("_signal_connector", "_get_current_signal_handlers", (), "restore the previous handlers at teardown"),
    ("_signal_connector", "received_sigterm", None, "stop all ranks together after a signal"),
    ("fit_loop.epoch_loop", "_broadcast_sigterm_tensor", (), "drop the per-batch SIGTERM broadcast (a host sync)"),
    ("fit_loop.epoch_loop", "advance", ("data_fetcher",), "agree on a signal before an optimizer step's first batch"),
    ("fit_loop.epoch_loop.batch_progress", "current", None, "know where an optimizer step starts"),
    (
        "_checkpoint_connector",
        "hpc_save_path",
        ("folderpath",),
        "name the checkpoint of a stopped run without a ModelCheckpoint",
    ),
)


def lightning_version_is_tested(version: str = lightning.__version__) -> bool:
    """Whether ``version`` lies in :data:`TESTED_LIGHTNING`."""
    low, high = TESTED_LIGHTNING
    return low <= Version(version) < high


def _resolve(trainer: Trainer, path: str) -> object | None:
    owner: object | None = trainer
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner


def missing_internals(trainer: Trainer) -> list[str]:
    """Descriptions of the :data:`INTERNALS` that ``trainer`` lacks or whose signature changed."""
    missing = []
    for path, name, parameters, purpose in INTERNALS:
        owner = _resolve(trainer, path)
        where = f"Trainer.{path}.{name}"
        if (
            owner is None or not hasattr(type(owner), name) and name not in getattr(owner, "__dict__", {})
        ):  # no getattr: properties run
            missing.append(f"{where} (used to {purpose}) does not exist")
            continue
        if parameters is not None:
            found = tuple(inspect.signature(getattr(owner, name)).parameters)
            if found != parameters:
                missing.append(f"{where} takes {found}, expected {parameters}")
    return missing


def missing_internals_line(trainer: Trainer, user: str) -> str | None:
    """One short line saying what ``user`` lacks in this trainer's Lightning, or ``None`` if nothing is missing."""
    missing = missing_internals(trainer)
    if not missing:
        return None
    low, high = TESTED_LIGHTNING
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (
        f"{user} needs Lightning internals that this Lightning {lightning.__version__} does not have "
        f"(tested with >={low},<{high}): {missing[0]}{more}"
    )


def require_internals(trainer: Trainer, user: str) -> None:
    """Raise if a private Lightning internal that ``user`` needs has moved; warn on an untested version.

    Args:
        trainer: the trainer whose instances will be patched.
        user: the class name to put in the message.

    Raises:
        RuntimeError: one or more internals are missing or changed shape (one line naming the first).
    """
    line = missing_internals_line(trainer, user)
    if line is not None:
        raise RuntimeError(line)
    if not lightning_version_is_tested():
        low, high = TESTED_LIGHTNING
        rank_zero_warn(f"{user} was tested with Lightning >={low},<{high}; found {lightning.__version__}.")


class InstancePatches:
    """Attributes replaced on single objects (never on classes), undone in reverse order by :meth:`undo`."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, bool, object]] = []

    def replace(self, owner: object, name: str, replacement: object) -> None:
        """Set ``owner.name = replacement`` on the instance, remembering what was there."""
        had_own = name in vars(owner)
        self._undo.append((owner, name, had_own, vars(owner).get(name)))
        object.__setattr__(owner, name, replacement)

    def undo(self) -> None:
        """Restore every replaced attribute."""
        while self._undo:
            owner, name, had_own, previous = self._undo.pop()
            if had_own:
                object.__setattr__(owner, name, previous)
            else:
                object.__delattr__(owner, name)
