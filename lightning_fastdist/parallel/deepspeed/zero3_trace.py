"""Let DeepSpeed ZeRO-3 record its parameter trace when the model calls itself inside its forward.

ZeRO-3 records the order a step uses the modules in, to prefetch from it, and starts a new step whenever the root
module's forward begins. Lightning runs ``training_step`` as the root's forward and it calls ``self(x)``: the nested
call starts a new step mid-step, so every step throws the trace away (no prefetch, and host syncs).
"""

from __future__ import annotations

from typing import Any


def start_zero3_steps_at_the_outer_forward(engine: Any) -> bool:
    """Make ``engine`` (a ZeRO-3 ``DeepSpeedEngine``) begin a trace step at the outermost root forward only.

    Returns ``False`` (nothing changed) when the engine does not partition parameters.
    """
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None or getattr(offload, "fwd_pre_hook", None) is None:
        return False
    depth = 0

    def enter(module: Any, args: Any) -> None:
        nonlocal depth
        if depth == 0:
            offload.get_param_coordinator().reset_step()
        depth += 1

    def leave(module: Any, args: Any, output: Any) -> None:
        nonlocal depth
        depth -= 1

    offload.fwd_pre_hook.remove()
    # DeepSpeed removes both with its own hooks (parameter_offload.destroy).
    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(enter)
    offload.forward_hooks.append(offload.module.register_forward_hook(leave, always_call=True))
    return True
