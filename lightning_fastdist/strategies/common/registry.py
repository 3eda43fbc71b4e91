"""Each strategy's name for ``Trainer(strategy="...")`` and LightningCLI, in Lightning's registry."""

from __future__ import annotations

from lightning.pytorch.strategies import Strategy, StrategyRegistry


def register_once(strategy: type[Strategy], name: str, description: str) -> None:
    """Register ``strategy`` under ``name`` unless a first import of its module already did."""
    if name not in StrategyRegistry:
        StrategyRegistry.register(name, strategy, description=description)
