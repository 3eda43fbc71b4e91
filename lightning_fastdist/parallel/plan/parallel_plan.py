"""The plan every strategy applies to a model: its blocks, their activation checkpointing, compile, then a wrapper.

``ParallelPlan`` holds the options all strategies share, checked once, and is the one place they are described. The
wrapper is FSDP's ``fully_shard`` per block, DDP's ``DistributedDataParallel`` or nothing (DeepSpeed wraps later);
why the steps come in this order: ``docs/plan.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from torch import nn

from lightning_fastdist.parallel.plan.activation_checkpointing import (
    CheckpointingMode,
    apply_activation_checkpointing,
    validate_activation_checkpointing,
)
from lightning_fastdist.parallel.plan.blocks import (
    block_modules,
    call_sites,
    check_blocks_value,
    describe_blocks,
    resolve_blocks,
)
from lightning_fastdist.parallel.plan.compile import apply_compile, normalize_compile_config, validate_compile_scope
from lightning_fastdist.parallel.plan.kv_cache import turn_off_kv_cache
from lightning_fastdist.parallel.plan.shared_parameters import blocks_sharing_parameters, describe_kept_blocks

# The types of the shared options, as strategy signatures (and so LightningCLI) take them.
BlocksOption = Literal["auto"] | list[str]
CheckpointingOption = CheckpointingMode | int
CompileOption = bool | dict[str, Any]
CompileScope = Literal["blocks", "model"]

Wrapped = TypeVar("Wrapped")


@dataclass(frozen=True)
class PreparedBlocks:
    """What steps 1-4 of the plan did to a model, for the wrapper and for whoever inspects it.

    Attributes:
        block_classes: the resolved block classes (empty when nothing needed them).
        checkpointed: the blocks under activation checkpointing, in module order.
        selective: whether that checkpointing is ``"selective"`` (FSDP then casts their inputs itself).
        compiled: the modules whose ``forward`` is compiled ("compiled regions").
        compiled_call_sites: for each compiled block class that runs at two or more places in the model (T5's
            encoder and decoder), those places.
    """

    block_classes: tuple[type[nn.Module], ...] = ()
    checkpointed: tuple[nn.Module, ...] = ()
    selective: bool = False
    compiled: tuple[nn.Module, ...] = ()
    compiled_call_sites: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ParallelPlan:
    """The options every strategy shares, checked once here, and the order they are applied in (module docstring).

    Args:
        blocks: ``"auto"``, the outermost repeated modules that hold layers (TinyGPT's ``Block``,
            GPT-2's ``GPT2Block``, encoder and decoder layers; see
            :func:`~lightning_fastdist.parallel.plan.blocks.find_blocks`), or a list of class names
            (``"Block"`` or ``"my_pkg.model.Block"``). The units of activation checkpointing,
            per-block compile and FSDP sharding; rank 0 logs one line saying which were found.
        activation_checkpointing: ``"none"``, ``"full"`` (keep each block's input, recompute the
            block in backward), ``"selective"`` (keep the outputs of matmuls and attention,
            recompute norms, activations and element-wise ops) or an integer ``n`` (full
            checkpointing of every n-th block).
        compile: ``false``, ``true`` (``torch.compile``'s defaults: inductor) or a mapping of
            ``torch.compile`` arguments (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``).
        compile_scope: ``"blocks"`` (compile each block's forward: one graph reused by every
            identical block, so compile time does not grow with depth) or ``"model"`` (the model's
            forward, called by ``self(...)``).
    """

    blocks: BlocksOption | tuple[str, ...] = "auto"
    activation_checkpointing: CheckpointingOption = "none"
    compile: CompileOption = False
    compile_scope: CompileScope = "blocks"
    compile_config: dict[str, Any] | None = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_blocks_value(self.blocks)
        if self.blocks != "auto":
            object.__setattr__(self, "blocks", tuple(self.blocks))
        validate_activation_checkpointing(self.activation_checkpointing)
        object.__setattr__(self, "compile_config", normalize_compile_config(self.compile))
        validate_compile_scope(self.compile_scope)

    @property
    def compiles_blocks(self) -> bool:
        return self.compile_config is not None and self.compile_scope == "blocks"

    def apply(
        self,
        model: nn.Module,
        wrap: Callable[[nn.Module, PreparedBlocks], Wrapped] | None = None,
        *,
        wrapper_uses_blocks: bool = False,
        without_blocks: str = "",
        log: Callable[[str], object] = lambda line: None,
    ) -> tuple[Wrapped | nn.Module, PreparedBlocks]:
        """Apply the plan to ``model`` in place, in docs/plan.md's order; return ``wrap``'s result and the blocks.

        Args:
            wrap: the wrapper, called last with the model and what the plan did to its blocks.
            wrapper_uses_blocks: the wrapper makes each block a unit of its own (FSDP): resolve the blocks even
                when neither checkpointing nor compile needs them, and say which share a parameter outside them.
            without_blocks: appended to the blocks line when ``model`` has none (what the wrapper does instead).
            log: where the plan's lines go (a strategy passes rank 0's logger).
        """
        block_classes: list[type[nn.Module]] = []
        if wrapper_uses_blocks or self.activation_checkpointing != "none" or self.compiles_blocks:
            block_classes = resolve_blocks(model, self.blocks)
            line = describe_blocks(model, block_classes)
            if wrapper_uses_blocks:
                line += describe_kept_blocks(blocks_sharing_parameters(model, block_modules(model, block_classes)))
            log(line if block_classes else line + without_blocks)
        self._without_kv_cache(model, log)
        checkpointed = apply_activation_checkpointing(model, self.activation_checkpointing, block_classes)
        compiled: list[nn.Module] = []
        if self.compile_config is not None:
            compiled = apply_compile(model, self.compile_config, self.compile_scope, block_classes)
        prepared = PreparedBlocks(
            tuple(block_classes),
            tuple(checkpointed),
            self.activation_checkpointing == "selective",
            tuple(compiled),
            call_sites(model, compiled),
        )
        return (wrap(model, prepared) if wrap is not None else model), prepared

    def _without_kv_cache(self, model: nn.Module, log: Callable[[str], object]) -> None:
        reasons = ["activation checkpointing"] if self.activation_checkpointing != "none" else []
        reasons += ["per-block compile"] if self.compiles_blocks else []
        changed = turn_off_kv_cache(model) if reasons else []
        if changed:
            log(
                f"use_cache: off for training in {', '.join(changed)}: {' and '.join(reasons)} would meet "
                "HuggingFace's KV cache in a new state in every layer (generate() keeps its generation_config)."
            )
