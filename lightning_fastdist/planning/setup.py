"""One vocabulary for a training setup: the engine, its sharding, activation checkpointing, offload, comm hook and
the form it takes across nodes.

A setup is written three ways, all derived here so that renaming a strategy option breaks every command at once,
not one of them silently: its strategy section, its plan key (``("zero3", "full", False)``: the row of the memory
model, the advisor and ``doctor --simulate``) and its name in ``bench`` and ``tune`` (``fsdp-zero3-ac``). Which setups
take ``replica_groups`` is decided here too (:attr:`Setup.takes_replica_groups`), for the advisor, the simulation and
tune alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OUTER_SYNC_FORMS, OuterSyncForm, form_of
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.recipes.recipe import STRATEGY_CLASSES

Engine = Literal["DDP", "FSDP2", "DeepSpeed"]
_DEEPSPEED_PREFIX = "ds-"
_NAME_PREFIX = {"DDP": "ddp", "FSDP2": "fsdp", "DeepSpeed": "deepspeed"}
_ENGINE_WORDS = {"DDP": "DDP", "FSDP2": "FSDP", "DeepSpeed": "DeepSpeed"}
_SHARDING_WORDS = {"zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "hsdp": "HSDP"}


@dataclass(frozen=True)
class Setup:
    """How a model is trained across ranks.

    Args:
        engine: ``DDP``, ``FSDP2`` or ``DeepSpeed``.
        sharding: FSDP2's ``zero2``, ``zero3`` or ``hsdp``; DeepSpeed's stage as ``zero1``, ``zero2`` or
            ``zero3``; ``None`` under DDP.
        activation_checkpointing: ``none``, ``full``, ``selective`` (or every n-th block).
        offload: FSDP2's ``cpu_offload``; DeepSpeed's optimizer offload (and, at ZeRO-3, its parameters').
        comm_hook: DDP's gradient hook, or ``None`` for the strategy's default.
        outer_sync: across nodes, ``"diloco"`` or ``"streaming-diloco"``, or ``None``: every step.
        replica_groups: across nodes, each node a torchft replica group (a recipe's option, kept on whichever setup
            trains it, so it is left out of :attr:`name`: bench's and tune's rows never differ by it), or ``None``.
    """

    engine: Engine
    sharding: str | None = None
    activation_checkpointing: str | int = "none"
    offload: bool = False
    comm_hook: str | None = None
    outer_sync: OuterSyncForm | None = None
    replica_groups: ReplicaGroups | None = None

    @classmethod
    def from_plan_key(cls, mode: str, activation_checkpointing: str, offload: bool) -> Setup:
        """The setup of a memory-plan row (``("ds-zero2", "none", True)``)."""
        if mode == "ddp":
            return cls("DDP", None, activation_checkpointing, offload)
        if mode.startswith(_DEEPSPEED_PREFIX):
            return cls("DeepSpeed", mode.removeprefix(_DEEPSPEED_PREFIX), activation_checkpointing, offload)
        return cls("FSDP2", mode, activation_checkpointing, offload)

    @classmethod
    def from_strategy(cls, class_path: str, init_args: dict) -> Setup | None:
        """The setup a strategy section of ours trains (its defaults where an option is not given), else ``None``."""
        engine = next((engine for engine, path in STRATEGY_CLASSES.items() if path == class_path), None)
        checkpointing = init_args.get("activation_checkpointing", "none")
        outer = init_args.get("outer_sync")
        across_nodes = {
            "outer_sync": form_of(outer) if outer else None,
            "replica_groups": ReplicaGroups.of(init_args.get("replica_groups")),
        }
        if engine == "DDP":
            return cls("DDP", None, checkpointing, comm_hook=init_args.get("comm_hook"), **across_nodes)
        if engine == "FSDP2":
            sharding, offload = init_args.get("sharding", "zero3"), bool(init_args.get("cpu_offload"))
            return cls("FSDP2", sharding, checkpointing, offload, **across_nodes)
        if engine == "DeepSpeed":
            offload = bool(init_args.get("offload_optimizer"))
            return cls("DeepSpeed", f"zero{init_args.get('stage', 2)}", checkpointing, offload)
        return None

    @property
    def strategy_class(self) -> str:
        return STRATEGY_CLASSES[self.engine]

    @property
    def mode(self) -> str:
        """The memory model's and the simulation's name: ``ddp``, ``zero2``, ``zero3``, ``hsdp``, ``ds-zero1/2/3``."""
        if self.engine == "DeepSpeed":
            return _DEEPSPEED_PREFIX + self.sharding
        return self.sharding or "ddp"

    @property
    def plan_key(self) -> tuple[str, str | int, bool]:
        """``(mode, activation_checkpointing, offload)``: the simulated row that holds this setup's memory."""
        return self.mode, self.activation_checkpointing, self.offload

    @property
    def takes_replica_groups(self) -> bool:
        """Whether this setup's strategy trains under ``replica_groups``: DDP without PowerSGD (whose per-rank state
        assumes one world across nodes) and FSDP sharded inside each node (``hsdp`` replicates across nodes itself),
        never with ``outer_sync`` (the other form across nodes); DeepSpeed has no such option."""
        if self.outer_sync is not None:
            return False
        if self.engine == "DDP":
            return self.comm_hook != "powersgd"
        return self.engine == "FSDP2" and self.sharding != "hsdp"

    @property
    def name(self) -> str:
        """The name ``bench`` and ``tune`` give it: ``ddp-bf16``, ``fsdp-zero3-ac``, ``deepspeed-zero2-offload``."""
        parts = [_NAME_PREFIX[self.engine], self.sharding, self.comm_hook if self.comm_hook != "none" else None]
        parts.append(self.outer_sync)
        parts += ["ac" if self.activation_checkpointing == "full" else None, "offload" if self.offload else None]
        return "-".join(part for part in parts if part)

    def strategy_options(self) -> dict:
        """The strategy's ``init_args`` that make this setup; ``replica_groups`` after the others: it is the recipe's,
        carried onto the setup chosen for it."""
        options = self._engine_options()
        if self.replica_groups is not None:
            options["replica_groups"] = asdict(self.replica_groups)
        return options

    def _engine_options(self) -> dict:
        options: dict = {"activation_checkpointing": self.activation_checkpointing}
        if self.outer_sync is not None:
            options["outer_sync"] = dict(OUTER_SYNC_FORMS[self.outer_sync])
        if self.engine == "DDP":
            return options if self.comm_hook is None else {"comm_hook": self.comm_hook, **options}
        if self.engine == "FSDP2":
            return {"sharding": self.sharding, **options, "cpu_offload": self.offload}
        stage = int(self.sharding.removeprefix("zero"))
        return {
            "stage": stage,
            **options,
            "offload_optimizer": self.offload,
            "offload_parameters": self.offload and stage == 3,
        }

    def strategy_section(self) -> dict:
        """The ``trainer.strategy`` entry of a recipe that trains this setup."""
        return {"class_path": self.strategy_class, "init_args": self.strategy_options()}

    def describe(self) -> str:
        """The setup in words: ``FSDP ZeRO-3 + full activation checkpointing``."""
        parts = [" ".join(filter(None, (_ENGINE_WORDS[self.engine], _SHARDING_WORDS.get(self.sharding))))]
        if self.activation_checkpointing != "none":
            parts.append(f"{self.activation_checkpointing} activation checkpointing")
        if self.offload:
            optimizer_only = self.engine == "DeepSpeed" and self.sharding in ("zero1", "zero2")
            parts.append("optimizer offload" if optimizer_only else "CPU offload")
        if self.outer_sync is not None:
            parts.append(f"{'Streaming ' if self.outer_sync == 'streaming-diloco' else ''}DiLoCo across nodes")
        return " + ".join(parts)
