"""Every private torchft name this package relies on, in one place, checked against the installed torchft.

torchft has no public way to read which nodes a quorum holds, the state a healing node received before its step, or
where DiLoCo's schedule stands, so both forms across nodes read these names, which torchft may move in any release.
Listing each with its users makes an upgrade that moves one fail in one line, before any process starts
(``tests/project/test_torchft_private_names.py`` reads the source to keep the list complete).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
import warnings
from dataclasses import dataclass

from packaging.version import Version

# torchft versions whose internals were read and tested (lower bound inclusive, upper exclusive).
TESTED_TORCHFT = (Version("0.2.0"), Version("0.3.0"))


@dataclass(frozen=True)
class PrivateName:
    """Where a private torchft name is used (modules relative to ``lightning_fastdist``) and why."""

    used_in: tuple[str, ...]
    purpose: str


REPLICA_GROUPS_RUN = "parallel.across_nodes.replica_groups.run"
OUTER_SYNC_RUN = "parallel.across_nodes.outer_sync.run"
# Private attributes read, set or called on torchft's objects, by the class that defines them.
PRIVATE_ATTRIBUTES = {
    "torchft.manager.Manager._client": PrivateName(
        ("parallel.across_nodes.group",), "wrap the manager's client to see which nodes each quorum holds"
    ),
    "torchft._torchft.ManagerClient._quorum": PrivateName(
        ("parallel.across_nodes.group",), "read each quorum's members and the node a healing node recovers from"
    ),
    "torchft.manager.Manager._manager": PrivateName(
        ("parallel.across_nodes.torchft_servers",),
        "check that the Manager built its server through torchft.manager.ManagerServer, which is bound to the node's "
        "job address while it is built (the Manager gives it [::])",
    ),
    "torchft.manager.Manager._quorum_future": PrivateName(
        ("parallel.across_nodes.node_run",),
        "wait for a restarted node's first quorum while reading the register (the job may end meanwhile)",
    ),
    "torchft.manager.Manager._pending_state_dict": PrivateName(
        (REPLICA_GROUPS_RUN,), "take the state a rejoining node received before its first step"
    ),
    "torchft.local_sgd.DiLoCo._local_step": PrivateName(
        (OUTER_SYNC_RUN,), "save, resume and send where the outer synchronisation's schedule stands"
    ),
    "torchft.local_sgd.DiLoCo._sync_every": PrivateName((OUTER_SYNC_RUN,), "know when a rejoining node syncs"),
    "torchft.local_sgd.DiLoCo._fragments": PrivateName(
        (OUTER_SYNC_RUN,), "evaluate on the global weights; start a rejoining node's sync"
    ),
    "torchft.local_sgd.DiLoCo._current_fragment": PrivateName(
        (OUTER_SYNC_RUN,), "know which fragment a rejoining node syncs first"
    ),
}


def torchft_version() -> Version:
    return Version(importlib.metadata.version("torchft"))


def missing_torchft_names() -> list[str]:
    """One line for each name in :data:`PRIVATE_ATTRIBUTES` the installed torchft lacks."""
    missing = []
    for dotted, use in PRIVATE_ATTRIBUTES.items():
        module, owner, name = dotted.rsplit(".", 2)
        try:
            found = _defines(getattr(importlib.import_module(module), owner), name)
        except (ImportError, AttributeError):
            found = False
        if not found:
            missing.append(
                f"{dotted} (used in {', '.join(use.used_in)} to {use.purpose}) is not in torchft {torchft_version()}"
            )
    return missing


def require_torchft_names(user: str) -> None:
    """Raise if a private torchft name that ``user`` needs has moved; warn on an untested torchft. The installed torchft
    is read once per process.

    Raises:
        RuntimeError: one line naming the first missing name.
    """
    missing, version = installed_torchft()
    low, high = TESTED_TORCHFT
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RuntimeError(
            f"{user} needs torchft internals that this torchft {version} does not have (tested with >={low},<{high}): "
            f"{missing[0]}{more}"
        )
    if not low <= version < high:
        warnings.warn(f"{user} was tested with torchft >={low},<{high}; found {version}.", stacklevel=2)


@functools.cache
def installed_torchft() -> tuple[list[str], Version]:
    """What :func:`missing_torchft_names` finds in the installed torchft, and its version."""
    return missing_torchft_names(), torchft_version()


def _defines(owner: type, attribute: str) -> bool:
    """Whether torchft's class ``owner`` has ``attribute``, or a class in its MRO sets it on ``self``."""
    assigned = re.compile(rf"self\.{attribute}\b")
    return hasattr(owner, attribute) or any(assigned.search(_source_of(cls)) for cls in inspect.getmro(owner))


def _source_of(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # a compiled class (torchft's Rust client, object) has no Python source
        return ""
