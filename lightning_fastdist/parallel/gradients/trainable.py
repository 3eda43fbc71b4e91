"""Which parameters a model trains now, to notice when a callback freezes or unfreezes some (``BackboneFinetuning``,
``requires_grad_`` in a hook): DDP's reducer and the flat gradients sent across nodes cover the parameters that were
trainable when they were built, and silently leave out the others."""

from __future__ import annotations

from torch import nn


class TrainableSet:
    """The ``requires_grad`` of each of a model's parameters, as last seen."""

    def __init__(self, model: nn.Module) -> None:
        self._flags = self._read(model)

    @staticmethod
    def _read(model: nn.Module) -> tuple[bool, ...]:
        return tuple(parameter.requires_grad for parameter in model.parameters())

    def changed(self, model: nn.Module) -> str | None:
        """What changed since last seen (``"2 parameters became trainable"``), and remember the new set; ``None``
        where nothing did. A host-side check, a few microseconds per hundred parameters."""
        flags = self._read(model)
        if flags == self._flags:
            return None
        became = sum(now and not before for now, before in zip(flags, self._flags))
        frozen = sum(before and not now for now, before in zip(flags, self._flags))
        self._flags = flags
        counts = ((became, "became trainable"), (frozen, "froze"))
        return " and ".join(f"{count} parameter{'s' if count != 1 else ''} {what}" for count, what in counts if count)
