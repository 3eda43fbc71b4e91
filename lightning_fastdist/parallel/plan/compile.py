"""``torch.compile`` applied to each repeated block (default) or to the model's forward.

Per-block compilation reuses one block's graph for every identical block, so compile time does not grow with depth,
and FSDP's and checkpointing's hooks stay eager around each compiled ``forward``. CUDA graphs are refused: a replayed
graph uses fixed addresses, which move here (shared graphs, checkpointing's replay, FSDP's re-allocated weights).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_fastdist.parallel.plan.blocks import outermost_block_modules

COMPILE_SCOPES = ("blocks", "model")
COMPILE_OPTIONS = ("backend", "mode", "fullgraph", "dynamic", "options")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs
CUDA_GRAPH_BACKEND = "cudagraphs"
# torch's debugging backends a user does pick (to tell a compiler problem from a graph-capture one).
DEBUG_BACKENDS_OFFERED = ("eager", "aot_eager")


def compiled_by_user(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it was compiled before the plan saw it: ``torch.compile(module)`` (an
    ``OptimizedModule``) or ``module.compile()`` (its call compiled in place)."""
    return any(
        isinstance(inner, torch._dynamo.eval_frame.OptimizedModule) or getattr(inner, "_compiled_call_impl", None)
        for inner in module.modules()
    )


def compile_backends() -> list[str]:
    """Names ``torch.compile`` accepts as ``backend`` in this installation (its test-only ones too)."""
    import torch._dynamo  # noqa: PLC0415 - heavy import, only when compiling

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})


def offered_backends() -> list[str]:
    """The backends named in an error: torch's user-facing ones and the debugging ones, without test-only backends
    or CUDA graphs."""
    import torch._dynamo  # noqa: PLC0415 - heavy import, only when compiling

    offered = set(torch._dynamo.list_backends()) | {"inductor"} | set(DEBUG_BACKENDS_OFFERED)
    return sorted((offered & set(compile_backends())) - {CUDA_GRAPH_BACKEND})


def cuda_graph_setting(config: Mapping[str, Any]) -> str | None:
    """The ``compile`` setting that would record CUDA graphs (``"mode='reduce-overhead'"``, ...), or ``None``."""
    if config.get("mode") in CUDA_GRAPH_MODES:
        return f"mode={config['mode']!r}"
    if config.get("backend") == CUDA_GRAPH_BACKEND:
        return f"backend={CUDA_GRAPH_BACKEND!r}"
    options = config.get("options")
    if isinstance(options, Mapping) and options.get("triton.cudagraphs"):
        return "options={'triton.cudagraphs': True}"
    return None


def normalize_compile_config(compile: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check a strategy's ``compile`` option; return ``torch.compile`` keyword arguments, or ``None`` for off.

    Args:
        compile: ``False``/``None`` (off), ``True`` (torch's defaults), or a mapping of ``COMPILE_OPTIONS``.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, Mapping):
        raise ValueError(
            f"compile: expected true, false or a mapping of {', '.join(COMPILE_OPTIONS)}; got {compile!r}."
        )
    config = dict(compile)
    unknown = sorted(set(config) - set(COMPILE_OPTIONS))
    if unknown:
        raise ValueError(f"compile: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(COMPILE_OPTIONS)}.")
    cuda_graphs = cuda_graph_setting(config)
    if cuda_graphs is not None:
        raise ValueError(
            f"compile: {cuda_graphs} records CUDA graphs, which per-block compile, activation checkpointing and "
            "FSDP's re-allocated weights break on replay; use mode='max-autotune-no-cudagraphs' (or the default mode)."
        )
    backend = config.get("backend")
    if isinstance(backend, str) and backend not in compile_backends():
        raise ValueError(
            f"compile.backend: {backend!r} is not a torch.compile backend; accepted: {', '.join(offered_backends())}."
        )
    mode = config.get("mode")
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"compile.mode: {mode!r} is not a torch.compile mode; accepted: {', '.join(COMPILE_MODES)}.")
    if mode is not None and config.get("options"):
        raise ValueError("compile: set either mode or options, not both (torch.compile refuses the pair).")
    dynamic = config.get("dynamic")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(f"compile.dynamic: expected true, false or null; got {dynamic!r}.")
    fullgraph = config.get("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise ValueError(f"compile.fullgraph: expected true or false; got {fullgraph!r}.")
    options = config.get("options")
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"compile.options: expected a mapping of inductor options; got {options!r}.")
    return config


def validate_compile_scope(scope: str) -> str:
    """Return ``scope`` if it is ``"blocks"`` or ``"model"``, else raise one clear ``ValueError``."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope: got {scope!r}; accepted values: {', '.join(map(repr, COMPILE_SCOPES))}.")
    return scope


def apply_compile(
    model: nn.Module, config: Mapping[str, Any], scope: str, block_classes: Sequence[type[nn.Module]]
) -> list[nn.Module]:
    """Compile, in place, the ``forward`` of each outermost block (scope ``"blocks"``) or of ``model`` itself.

    Returns the modules whose ``forward`` is now compiled ("compiled regions").
    """
    validate_compile_scope(scope)
    if scope == "model":
        targets = [model]
    else:
        targets = outermost_block_modules(model, block_classes)
        if not targets:
            names = ", ".join(cls.__name__ for cls in block_classes) or "none found"
            raise ValueError(
                f"compile_scope='blocks' found no block to compile in {type(model).__name__} (block classes: {names}); "
                "name its repeated layers with blocks=[...] or use compile_scope='model'."
            )
    for module in targets:
        module.forward = torch.compile(module.forward, **config)
    return targets
