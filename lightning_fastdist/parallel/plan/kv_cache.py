"""HuggingFace's KV cache, turned off for training whose blocks are checkpointed or compiled one by one.

A HuggingFace decoder whose ``config.use_cache`` is on (the default) builds a KV
cache in every forward, training included, and hands it to each layer, which
appends its keys and values to it. A checkpointed layer appends them a second
time when backward recomputes it (inductor's backward then fails on mismatched
strides), and a layer compiled on its own meets the cache in a new state in
every layer: one recompile per layer, and eager code once torch's recompile
limit is reached. Training never reads the cache; ``generate()`` follows the
model's ``generation_config``, which this leaves alone.
"""

from __future__ import annotations

from torch import nn


def turn_off_kv_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` wherever a module of ``model`` has a config with it on.

    Returns:
        The names of the modules whose config changed (a config shared by several modules counts once).
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
