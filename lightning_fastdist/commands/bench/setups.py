"""The setups ``lightning-fastdist bench`` compares, as strategy overrides of one recipe: three engines (DDP, FSDP2,
DeepSpeed ZeRO), each as our strategy in several configurations and as Lightning's own strategy unchanged (the
``lightning-*`` baselines, what a user has without this package, in Lightning's own precision plugin), which the
engine's rows are compared with. Two rows measure the ends of the scale on one GPU: ``fast-default`` (our strategy and
precision plugin with no option set) and ``hand-loop`` (the same model, data and optimizer in a plain PyTorch loop,
compiled whole, no Trainer: ``hand_loop.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fastdist.parallel.across_nodes.group import INSTALL_HINT as TORCHFT_HINT
from lightning_fastdist.parallel.across_nodes.group import torchft_available
from lightning_fastdist.parallel.deepspeed.runtime import INSTALL_HINT, deepspeed_available
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.recipes.recipe import DEFAULT_MODEL, STRATEGY_CLASSES, Recipe

LIGHTNING_DDP = "lightning.pytorch.strategies.DDPStrategy"
LIGHTNING_FSDP2 = "lightning.pytorch.strategies.ModelParallelStrategy"
LIGHTNING_DEEPSPEED = "lightning.pytorch.strategies.DeepSpeedStrategy"
HAND_SHARDED_MODEL = "lightning_fastdist.commands.bench.baselines.HandShardedTinyGPT"
ENGINES = tuple(STRATEGY_CLASSES)
# Options the rows of our strategies compare besides their Setup's, at their defaults where a row does not set them:
# a recipe's own values would otherwise reach every row of the same class.
COMPARED_OPTIONS = {STRATEGY_CLASSES["DDP"]: {"compile": False}, STRATEGY_CLASSES["FSDP2"]: {"compile": False}}
DEEPSPEED_ROWS = (("zero1", False), ("zero2", False), ("zero3", False), ("zero2", True), ("zero3", True))  # offload
BASELINES = {"DDP": "lightning-ddp", "FSDP2": "lightning-fsdp2", "DeepSpeed": "lightning-deepspeed"}
# Where a row's precision comes from: the recipe's trainer options as written; Lightning's own plugin for the recipe's
# precision (``trainer.precision``, our FastMixedPrecision removed); or our FastMixedPrecision with no other option.
PRECISION_SOURCES = ("recipe", "lightning", "ours")
RUNNERS = ("fit", "hand-loop")  # lightning-fastdist fit, or the hand-written loop (hand_loop.py)


@dataclass(frozen=True)
class BenchSetup:
    """One row of the comparison.

    Args:
        name: as given to ``--setups``.
        engine: one of ``ENGINES``.
        model_class: a model class to train instead of the recipe's (keeping its ``init_args``), or ``None``.
        exact: computes what plain fp32 data parallelism computes, so its loss must match the other exact rows'.
        all_ranks_data_parallel: Lightning's ``ModelParallelStrategy`` with every rank in its data-parallel
            dimension (by default a node's ranks are tensor-parallel, where a model sharded over
            ``device_mesh["data_parallel"]`` is not sharded at all and every rank reads the same batch).
        needs: a reason this setup cannot run here, or ``None`` if it can.
        multi_node: synchronises across nodes (``outer_sync``): it needs ``--nodes 2`` or more.
        keeps_recipe_options: the recipe's strategy options reach this row as they are; otherwise those in
            ``COMPARED_OPTIONS`` are the row's own or their defaults (the recipe's others are kept either way).
        bare: the strategy gets ``strategy_args`` only, none of the recipe's options: Lightning's strategies as
            Lightning has them, ours with our defaults (as a user who writes ``FastDDPStrategy()`` has them).
        precision: one of ``PRECISION_SOURCES``.
        runner: one of ``RUNNERS``.
    """

    name: str
    engine: str
    strategy_class: str
    strategy_args: dict[str, Any] = field(default_factory=dict)
    model_class: str | None = None
    exact: bool = True
    all_ranks_data_parallel: bool = False
    needs: str | None = None
    multi_node: bool = False
    keeps_recipe_options: bool = False
    bare: bool = False
    precision: str = "recipe"
    runner: str = "fit"

    @property
    def baseline(self) -> str:
        """The row of Lightning's own strategy for this engine."""
        return BASELINES[self.engine]

    @property
    def uses_deepspeed(self) -> bool:
        return self.engine == "DeepSpeed"

    def strategy_config(self, world_size: int | None) -> dict[str, Any]:
        """The ``trainer.strategy`` entry for a run of ``world_size`` ranks."""
        init_args = dict(self.strategy_args)
        if not self.keeps_recipe_options and not self.bare:
            init_args = {**COMPARED_OPTIONS.get(self.strategy_class, {}), **init_args}
        if self.all_ranks_data_parallel:
            init_args.update(data_parallel_size=world_size, tensor_parallel_size=1)
        return {"class_path": self.strategy_class, "init_args": init_args}

    def unavailable(self, recipe: Recipe, world_size: int | None, nodes: int = 1) -> str | None:
        """Why this setup cannot train ``recipe`` on ``world_size`` ranks of ``nodes`` nodes, or ``None``."""
        if self.needs:
            return self.needs
        if self.multi_node and nodes < 2:
            return "synchronises across nodes: give --nodes 2 or more (and a --launcher that starts them)"
        if self.runner == "hand-loop" and (world_size != 1 or nodes != 1):
            return f"the hand-written loop runs one process: give --devices 1 (this run has {world_size} ranks)"
        if self.all_ranks_data_parallel and world_size is None:
            return "needs the number of ranks: give --devices N (the recipe's trainer.devices is not a number)"
        model = recipe.class_path("model")
        if self.model_class is not None and model != DEFAULT_MODEL:
            return f"its configure_model is written for {DEFAULT_MODEL}, the recipe trains {model}"
        if self.runner == "hand-loop" and model != DEFAULT_MODEL:
            return f"the hand-written loop calls {DEFAULT_MODEL}'s forward(inputs, targets), the recipe trains {model}"
        accelerator = recipe.trainer.get("accelerator", "auto")
        on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
        if self.strategy_class == LIGHTNING_DEEPSPEED and on_cpu:
            return "Lightning's DeepSpeedStrategy runs on CUDA only (it refuses the CPU accelerator)"
        return None


_ENGINE_OF_CLASS = {
    **{class_path: engine for engine, class_path in STRATEGY_CLASSES.items()},
    LIGHTNING_DDP: "DDP",
    LIGHTNING_FSDP2: "FSDP2",
    LIGHTNING_DEEPSPEED: "DeepSpeed",
}


def recipe_setup(recipe: Recipe) -> BenchSetup:
    """The ``recipe`` row: the recipe's own ``trainer.strategy``, unchanged (e.g. one ``tune`` wrote)."""
    strategy = recipe.trainer.get("strategy")
    class_path = strategy.get("class_path") if isinstance(strategy, dict) else None
    if class_path not in _ENGINE_OF_CLASS:
        known = ", ".join(sorted(_ENGINE_OF_CLASS))
        reason = f"the recipe's trainer.strategy is {strategy!r}; this row needs a class_path, one of {known}"
        return BenchSetup("recipe", "DDP", str(class_path), exact=False, needs=reason)
    engine = _ENGINE_OF_CLASS[class_path]
    return BenchSetup("recipe", engine, class_path, recipe.strategy_options, exact=False, keeps_recipe_options=True)


def ours(setup: Setup, name: str | None = None, exact: bool = True, needs: str | None = None, **options) -> BenchSetup:
    """The row of our strategy that trains ``setup`` (named as the setup is, unless ``name``), with more ``options``."""
    return BenchSetup(
        name or setup.name,
        setup.engine,
        setup.strategy_class,
        {**setup.strategy_options(), **options},
        exact=exact,
        needs=needs,
        multi_node=setup.outer_sync is not None,
    )


def all_setups(compile_backend: str = "inductor") -> dict[str, BenchSetup]:
    """Every setup bench knows, by name, in the order the table lists them."""
    no_deepspeed = None if deepspeed_available() else f"deepspeed is not installed ({INSTALL_HINT})"
    no_torchft = None if torchft_available() else f"torchft is not installed ({TORCHFT_HINT})"
    setups = [
        BenchSetup("lightning-ddp", "DDP", LIGHTNING_DDP, bare=True, precision="lightning"),
        BenchSetup(
            "lightning-fsdp2",
            "FSDP2",
            LIGHTNING_FSDP2,
            model_class=HAND_SHARDED_MODEL,
            all_ranks_data_parallel=True,
            bare=True,
            precision="lightning",
        ),
        BenchSetup(
            "lightning-deepspeed",
            "DeepSpeed",
            LIGHTNING_DEEPSPEED,
            {"stage": 2},
            needs=no_deepspeed,
            bare=True,
            precision="lightning",
        ),
        ours(Setup("DDP", comm_hook="none")),  # exact: fp32 gradients always
        ours(Setup("DDP", comm_hook="auto"), exact=False),  # the default: may compress
        ours(Setup("DDP", comm_hook="fp16"), exact=False),
        ours(Setup("DDP", comm_hook="bf16"), exact=False),
        # PowerSGD at its default rank, compressing from step 2: a few steps show its steady state.
        ours(Setup("DDP", comm_hook="powersgd"), exact=False, powersgd_start_iter=2),
        ours(Setup("DDP", comm_hook="none"), name="ddp-compile", compile={"backend": compile_backend}),
        # FastDDPStrategy() + FastMixedPrecision(the recipe's precision): what a user gets without setting anything.
        BenchSetup("fast-default", "DDP", STRATEGY_CLASSES["DDP"], exact=False, bare=True, precision="ours"),
        # The same model, data, optimizer and precision in a plain PyTorch loop compiled whole: the ceiling. Exact: one
        # process, gradients as computed.
        BenchSetup("hand-loop", "DDP", "torch", {"compile": {"backend": compile_backend}}, runner="hand-loop"),
        ours(Setup("FSDP2", "zero2")),
        ours(Setup("FSDP2", "zero3")),
        ours(Setup("FSDP2", "zero3", activation_checkpointing="full")),
        ours(Setup("FSDP2", "hsdp")),  # shards within a node
        # Across nodes, every `every` steps (semi-synchronous): not what exact DDP computes.
        ours(Setup("DDP", comm_hook="none", outer_sync="diloco"), exact=False, needs=no_torchft),
        ours(Setup("DDP", comm_hook="none", outer_sync="streaming-diloco"), exact=False, needs=no_torchft),
        ours(Setup("FSDP2", "zero3", outer_sync="diloco"), exact=False, needs=no_torchft),  # sharded in each node
        ours(Setup("FSDP2", "zero3", outer_sync="streaming-diloco"), exact=False, needs=no_torchft),
        *(ours(Setup("DeepSpeed", stage, offload=offload), needs=no_deepspeed) for stage, offload in DEEPSPEED_ROWS),
    ]
    return {setup.name: setup for setup in setups}
