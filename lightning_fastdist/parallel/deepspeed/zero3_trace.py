"""Let DeepSpeed ZeRO-3 record its parameter trace when the model calls itself inside its forward.

ZeRO-3 records the order in which a forward and backward use the modules (its
trace), then prefetches each module's parameters ahead of use from that order.
It starts a new step whenever the root module's forward begins. A
LightningModule is called twice, nested: Lightning routes ``training_step``
through the engine by making it the root's ``forward`` for one call, and
``training_step`` calls ``self(x)``. The inner call starts a new step in the
middle of the outer one, so the recorded trace holds one module, every step
finds the order changed and throws the trace away: no prefetch, and each step
checks the new trace against the other ranks (a dozen host syncs and
broadcasts per step on TinyGPT). Lightning's own ``DeepSpeedStrategy`` behaves
the same.

:func:`start_zero3_steps_at_the_outer_forward` replaces that root hook with one
that starts a step only when no forward of the root is running already.
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
