"""HuggingFace's KV cache, turned off for training whose blocks are checkpointed or compiled one by one.

With ``config.use_cache`` on, every forward builds a cache each layer appends to: a checkpointed layer appends twice
(inductor's backward fails on the strides) and a per-layer compile recompiles per layer. Training never reads the
cache, and ``generate()`` follows ``generation_config``, which this leaves alone.
"""

from __future__ import annotations

from torch import nn


def turn_off_kv_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` wherever a module of ``model`` has a config with it on.

    Returns the names of the modules whose config changed (a config shared by several modules counts once).
    """
    changed: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True and id(config) not in seen:
            seen.add(id(config))
            config.use_cache = False
            changed.append(name or type(model).__name__)
    return changed
