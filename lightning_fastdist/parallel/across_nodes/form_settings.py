"""What the settings of both forms across nodes share (``OuterSync``, ``ReplicaGroups``): how a recipe's mapping
becomes settings, and the one rule on the node count, asked by the strategies before any process starts and by
``doctor`` and ``tune`` before they plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar, TypeVar

SettingsT = TypeVar("SettingsT", bound="FormSettings")


class FormSettings:
    """The base of a form's settings, each a frozen dataclass (this base is none: its names are not fields).

    Attributes:
        option: the strategy option that holds these settings (``"outer_sync"``).
        required: fields a recipe's mapping must give, each with the line that says what it is.
        min_nodes: the fewest nodes the job trains on (``None``: every node), a field of each form's settings.
    """

    option: ClassVar[str]
    required: ClassVar[dict[str, str]] = {}
    min_nodes: int | None

    @classmethod
    def of(cls: type[SettingsT], value: SettingsT | Mapping[str, Any] | None) -> SettingsT | None:
        """``value`` as settings: the settings themselves, a mapping of their fields (a recipe's), or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        accepted = [f.name for f in fields(cls)]
        if not isinstance(value, Mapping):
            raise ValueError(f"{cls.option} must be a mapping of {accepted}, not {value!r}.")
        unknown = sorted(set(value) - set(accepted))
        if unknown:
            raise ValueError(f"{cls.option} has no option {unknown[0]!r}: accepted are {accepted}.")
        for name, meaning in cls.required.items():
            if name not in value:
                raise ValueError(f"{cls.option} needs {name}: {meaning}.")
        return cls(**value)

    def check_nodes(self, nodes: int, nodes_name: str) -> None:
        """Raise the one-line ``ValueError`` where ``nodes`` nodes cannot train this form: it crosses nodes (2 or
        more), and waits for ``min_nodes`` of them. ``nodes_name``: how the caller's user gives the count
        (``num_nodes``, ``--nodes``)."""
        if nodes < 2:
            raise ValueError(
                f"{self.option} synchronises across nodes and this job has {nodes_name}={nodes}: give {nodes_name} 2 "
                f"or more, or remove {self.option}."
            )
        if self.min_nodes is not None and self.min_nodes > nodes:
            raise ValueError(
                f"{self.option}.min_nodes={self.min_nodes} is more than the job's {nodes_name}={nodes}: give min_nodes "
                f"1 to {nodes}, or {nodes_name} {self.min_nodes} or more."
            )
