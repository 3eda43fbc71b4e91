"""The setups ``lightning-fastdist tune`` may try (bench's rows of our strategies, with activation checkpointing,
per-block compile and micro-batch x accumulation varied around them), and the memory plan that prunes them before
any starts, by tracing the recipe's step as ``doctor --simulate`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_fastdist.commands.bench.setups import BenchSetup
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync, OuterSyncForm, form_of
from lightning_fastdist.parallel.plan.activation_checkpointing import LEAST_RECOMPUTE_FIRST
from lightning_fastdist.planning.memory_model import GiB
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.recipe_run import NotTraceable, RecipeRun
from lightning_fastdist.planning.simulation.result import Simulation
from lightning_fastdist.planning.simulation.simulate import simulate
from lightning_fastdist.recipes.recipe import STRATEGY_CLASSES, Recipe

# Bench's rows that tune tries by default (``offered`` drops those that cannot run here).
DEFAULT_SETUPS = (
    "ddp", "ddp-bf16", "ddp-powersgd", "ddp-diloco", "ddp-streaming-diloco", "fsdp-zero2", "fsdp-zero3", "fsdp-hsdp",
    "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
)  # fmt: skip
TUNABLE_CLASSES = tuple(STRATEGY_CLASSES.values())


def offered(setup: BenchSetup, across_nodes: bool, replica_groups: bool = False) -> bool:
    """Whether tune tries ``setup`` on a job across nodes or on one: ``fsdp-hsdp`` (one node leaves it nothing to
    replicate across) and the ``outer_sync`` rows only across nodes, those only where they can run. Under a recipe's
    ``replica_groups`` only the rows whose strategies take it (``Setup.takes_replica_groups``, as doctor plans
    them): a DeepSpeed winner would drop the option from the recipe written."""
    if replica_groups:
        planned = Setup.from_strategy(setup.strategy_class, setup.strategy_args)
        return planned is not None and planned.takes_replica_groups
    if setup.multi_node:
        return across_nodes and setup.needs is None
    return across_nodes or setup.name != "fsdp-hsdp"


@dataclass(frozen=True)
class Candidate:
    """One setup tune may train.

    Args:
        checkpointing: ``activation_checkpointing`` (``none``, ``selective`` or ``full``).
        compile_backend: per-block ``torch.compile`` with this backend, or ``None``.
        micro_batch: ``data.init_args.batch_size``, or ``None`` for the recipe's.
        accumulation: ``trainer.accumulate_grad_batches``, or ``None`` for the recipe's.
        compared_with: the name of the candidate whose loss this one's must stay within tolerance of, or ``None``.
    """

    setup: BenchSetup
    checkpointing: str = "none"
    compile_backend: str | None = None
    micro_batch: int | None = None
    accumulation: int | None = None
    compared_with: str | None = None

    @property
    def name(self) -> str:
        parts = [self.setup.name]
        if self.checkpointing != "none":
            parts.append(f"ac-{self.checkpointing}")
        if self.compile_backend:
            parts.append("compile")
        if self.micro_batch is not None:
            parts.append(f"mb{self.micro_batch}x{self.accumulation}")
        return "+".join(parts)

    @property
    def plan_key(self) -> tuple[str, str | int, bool]:
        """The simulation row that holds this candidate's memory: the bench row's setup with its checkpointing."""
        return Setup.from_strategy(self.setup.strategy_class, self.bench_setup().strategy_args).plan_key

    def bench_setup(self) -> BenchSetup:
        """The setup bench's machinery trains: the strategy with this candidate's checkpointing and compile."""
        strategy_args = dict(self.setup.strategy_args)
        if self.checkpointing != "none":
            strategy_args["activation_checkpointing"] = self.checkpointing
        if self.compile_backend:
            strategy_args["compile"] = {"backend": self.compile_backend}
        return replace(self.setup, name=self.name, strategy_args=strategy_args)

    def fit_arguments(self) -> list[str]:
        """What ``fit`` is given on top of the recipe for this candidate's batch split."""
        if self.micro_batch is None:
            return []
        return [
            "--trainer.accumulate_grad_batches", str(self.accumulation),
            "--data.init_args.batch_size", str(self.micro_batch),
        ]  # fmt: skip


@dataclass
class MemoryPlan:
    """One device's memory and the recipe's step simulated at each micro-batch tune considers (traced once each).

    Args:
        usable_bytes: the device memory less headroom, or ``None``: nothing is planned, nothing pruned.
    """

    recipe: Recipe
    world_size: int
    gpus_per_node: int
    usable_bytes: int | None
    untraceable: str | None = None  # why the step could not be simulated (then nothing is pruned)
    _simulations: dict[int | None, Simulation | None] = field(default_factory=dict)

    def simulation(self, micro_batch: int | None) -> Simulation | None:
        """The step at ``micro_batch`` (``None``: the recipe's), or ``None`` without a plan or a trace."""
        if self.usable_bytes is None or self.untraceable is not None:
            return None
        if micro_batch not in self._simulations:
            try:
                run = RecipeRun.of(self.recipe, micro_batch)
                self._simulations[micro_batch] = simulate(run, self.world_size, self.gpus_per_node)
            except NotTraceable as error:
                self.untraceable = str(error)
                self._simulations[micro_batch] = None
        return self._simulations[micro_batch]


def larger_micro_batches(micro_batch: int | None, accumulation: int, limit: int = 2) -> list[tuple[int, int]]:
    """Up to ``limit`` splits of the same global batch into fewer, larger micro-batches (accumulation halved)."""
    splits = []
    while micro_batch is not None and accumulation % 2 == 0 and len(splits) < limit:
        micro_batch, accumulation = micro_batch * 2, accumulation // 2
        splits.append((micro_batch, accumulation))
    return splits


def smaller_micro_batch(micro_batch: int | None, accumulation: int) -> tuple[int, int] | None:
    """The same global batch in micro-batches half as large (twice the accumulation), or ``None``."""
    if micro_batch is None or micro_batch % 2:
        return None
    return micro_batch // 2, accumulation * 2


def memory_verdict(candidate: Candidate, plan: MemoryPlan) -> tuple[int | None, str | None]:
    """``(simulated peak bytes, why it cannot fit)``: ``(None, None)`` when there is no plan for it."""
    simulation = plan.simulation(candidate.micro_batch)
    if simulation is None:
        return None, None
    form = _outer_sync_form(candidate.setup.strategy_args.get("outer_sync"))
    row = next(
        (r for r in simulation.rows if r.plan_key == candidate.plan_key and _outer_sync_form(r.outer_sync) == form),
        None,
    )
    if row is None:
        traced = next(
            (reason for s, mode, reason in simulation.not_traced if (s, mode) == candidate.plan_key[:2]), None
        )
        return None, (f"the memory plan could not trace it, as training would fail: {traced}" if traced else None)
    if row.memory.peak > plan.usable_bytes:
        return row.memory.peak, (
            f"memory plan: peak {readable_bytes(row.memory.peak)} per rank > {readable_bytes(plan.usable_bytes)} usable"
        )
    return row.memory.peak, None


def _outer_sync_form(options: OuterSync | dict | None) -> OuterSyncForm | None:
    """``diloco`` or ``streaming-diloco`` (a simulated row holds the recipe's own options of its form), or ``None``."""
    return form_of(options) if options else None


def readable_bytes(count: int) -> str:
    """``count`` in GiB, MiB or KiB, whichever keeps three significant digits."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count / 2**10:.3g} KiB"


def least_checkpointing_that_fits(setup: BenchSetup, plan: MemoryPlan, **axes) -> tuple[Candidate, list[Candidate]]:
    """The candidate of ``setup`` with the least recompute that fits (``none`` first), and the modes that did not
    fit before it; with no plan, ``none``. When no mode fits, the ``none`` candidate is returned and pruned."""
    too_large = []
    for checkpointing in LEAST_RECOMPUTE_FIRST:
        candidate = Candidate(setup, checkpointing, **axes)
        _, reason = memory_verdict(candidate, plan)
        if reason is None:
            return candidate, too_large
        too_large.append(candidate)
    return too_large[0], too_large[1:]
