"""``lightning-fastdist tune``: measure which setup trains the recipe fastest here, and write it as a recipe.

Each candidate (our DDP with each gradient hook, FSDP2 ZeRO-2/3, HSDP and DiLoCo across nodes, DeepSpeed ZeRO-1/2/3,
then compile and larger micro-batches of the fastest) trains the recipe's own model, data and batch for a few steps
in fresh processes, as ``bench`` trains its rows (``--launcher`` runs them across nodes). Before any starts, the
memory plan (``doctor --simulate``'s trace of the recipe's step) prunes what cannot fit one device of
``--gpu-memory`` GiB (default: this machine's GPU; none on a CPU-only machine) and picks the least activation
checkpointing that fits. A compressed, semi-synchronous or compiled candidate is accepted only if its loss (on
held-out data, where the recipe validates) stays within ``--loss-tolerance`` of the exact setup it is compared with
at equal tokens. Successive halving then re-measures the fastest third with three times the steps until two have
been compared, within ``--budget-minutes``.

Writes the winner as a recipe (``--output``: the user's recipe with its strategy and batch split replaced, the
measured table as comments), every candidate's numbers (``--json``), and per run a log, in ``--workdir`` with
``tune.png``. It replaces only files it wrote itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from lightning_fastdist.commands.arguments import (
    PASSTHROUGH_EPILOG,
    check_steps,
    device_memory,
    positive,
    read_recipe,
    setup_names,
    split_passthrough,
)
from lightning_fastdist.commands.bench.setup_run import node_count, run_setup, world_size
from lightning_fastdist.commands.bench.setups import all_setups
from lightning_fastdist.commands.stopping import sigterm_ends_the_command
from lightning_fastdist.commands.tune import output as tune_output
from lightning_fastdist.commands.tune.candidates import (
    DEFAULT_SETUPS,
    TUNABLE_CLASSES,
    Candidate,
    MemoryPlan,
    least_checkpointing_that_fits,
    offered,
    smaller_micro_batch,
)
from lightning_fastdist.commands.tune.search import Search, Trial
from lightning_fastdist.commands.written_marks import claim_folder, write_json
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.advisor import HEADROOM

PROG = "lightning-fastdist tune"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PASSTHROUGH_EPILOG,
    )
    # Not the bare rows (our defaults with none of the recipe's options): tune keeps the recipe's options.
    tunable = [name for name, s in all_setups().items() if s.strategy_class in TUNABLE_CLASSES and not s.bare]
    parser.add_argument("--config", required=True, help="recipe to tune (a path or a packaged name)")
    parser.add_argument("--output", default="tuned.yaml", help="the winning recipe (default tuned.yaml)")
    parser.add_argument("--json", default=None, help="also write every candidate's numbers here")
    parser.add_argument("--workdir", default="tune_runs", help="folder for each run's log and tune.png")
    parser.add_argument(
        "--budget-minutes", type=positive(float), default=30.0, help="time the trials may take in all (default 30)"
    )
    parser.add_argument(
        "--setups", default=",".join(DEFAULT_SETUPS), help=f"comma-separated, of bench's: {', '.join(tunable)}"
    )
    parser.add_argument("--steps", type=positive(int), default=8, help="optimizer steps per trial in round 1")
    parser.add_argument("--warmup-steps", type=positive(int), default=2, help="steps left out of each timing")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the compile trials, or none"
    )
    parser.add_argument(
        "--loss-tolerance",
        type=positive(float),
        default=0.01,
        help="largest relative distance of a compressed or compiled candidate's loss from its exact one's",
    )
    parser.add_argument("--gpu-memory", type=positive(float), metavar="GIB", help="memory of one device in GiB")
    parser.add_argument("--devices", default=None, help="processes per node (default: the recipe's)")
    parser.add_argument("--nodes", type=positive(int), default=None, help="nodes (default: the recipe's num_nodes)")
    parser.add_argument("--launcher", default="", help="as bench's --launcher: runs each trial across the nodes")
    own, passthrough = split_passthrough(argv)
    args = parser.parse_args(own)
    args.passthrough = passthrough
    args.setup_list = setup_names(parser, args.setups, tunable)
    check_steps(parser, args.steps, args.warmup_steps)
    args.recipe = read_recipe(parser, args.config)
    replica_groups = args.recipe.strategy_options.get("replica_groups")
    nodes = node_count(args)
    if replica_groups is not None and isinstance(nodes, int):
        try:  # the form's own rule on the node count, as the strategy and doctor ask it
            ReplicaGroups.of(replica_groups).check_nodes(nodes, "--nodes")
        except ValueError as error:
            parser.error(f"--nodes: the recipe's {error}")
    args.compile_backend = None if args.compile_backend == "none" else args.compile_backend
    for problem in tune_output.outputs_not_ours(Path(args.output), args.json and Path(args.json), Path(args.workdir)):
        parser.error(problem)
    return args


def memory_plan(args: argparse.Namespace) -> MemoryPlan:
    """The device memory to plan for (``--gpu-memory``, else this machine's smallest GPU, else none)."""
    world = world_size(args) or 1
    memory = device_memory(args.gpu_memory)
    usable = int(memory * (1 - HEADROOM)) if memory else None
    return MemoryPlan(args.recipe, world, max(world // int(node_count(args)), 1), usable)


def base_candidates(args: argparse.Namespace, plan: MemoryPlan, split: tuple[int, int] | None) -> list[Candidate]:
    """The named setups offered here, each with the least checkpointing that fits, exact ones first; a non-exact one
    is compared with ``ddp`` at the same checkpointing and batch split (added when not named)."""
    setups = all_setups()
    across_nodes = plan.world_size > plan.gpus_per_node  # as the simulation decides whether to plan hsdp
    replica_groups = args.recipe.strategy_options.get("replica_groups") is not None
    names = [name for name in args.setup_list if offered(setups[name], across_nodes, replica_groups)]
    axes = {"micro_batch": split[0], "accumulation": split[1]} if split else {}
    exact, compressed = [], []
    for name in names:
        candidate, too_large = least_checkpointing_that_fits(setups[name], plan, **axes)
        if setups[name].exact:
            exact += [*too_large, candidate]
            continue
        reference = Candidate(setups["ddp"], candidate.checkpointing, **axes)
        if reference.name not in {c.name for c in exact}:
            exact.append(reference)
        compressed += [*too_large, replace(candidate, compared_with=reference.name)]
    return exact + compressed


def add_planned_candidates(
    search: Search, args: argparse.Namespace, plan: MemoryPlan
) -> tuple[list[Candidate], tuple[int | None, int]]:
    """Add the base candidates to ``search``, pruned by the plan before any trains; while none fits, the same
    global batch in micro-batches half as large. Returns the candidates and the batch split they use."""
    micro_batch, accumulation, split = args.recipe.micro_batch, args.recipe.accumulation, None
    while True:
        candidates = base_candidates(args, plan, split)
        for candidate in candidates:
            search.add(candidate)
        split = smaller_micro_batch(micro_batch, accumulation)
        if split is None or not all(t.status == "pruned" for t in search.trials.values()):
            return candidates, (micro_batch, accumulation)
        micro_batch, accumulation = split
        print(f"nothing fits: the same global batch as micro-batch {micro_batch} x {accumulation} accumulated")


def progress_line(trial: Trial, round_number: int, elapsed_s: float) -> str:
    """One line per decision: the candidate, its round, and its numbers or why it has none."""
    head = f"[{elapsed_s / 60:5.1f} min] round {round_number}  {trial.candidate.name:<32}"
    if trial.status in ("measured", "winner") and trial.rounds:
        guard = f"\n{'':>{len(head)}} guard: {trial.guard}" if trial.guard else ""
        return f"{head} {tune_output.numbers(trial.rounds[-1])}{guard}"
    return f"{head} {trial.status}: {trial.reason}"


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Prune, measure, halve; write the outputs. Exit status 1 when no candidate trained and passed."""
    started = time.monotonic()
    workdir = Path(args.workdir)
    claim_folder(workdir, "tune")
    plan = memory_plan(args)

    def measure(candidate: Candidate, steps: int, round_number: int) -> dict:
        folder = workdir / f"round{round_number}"
        folder.mkdir(parents=True, exist_ok=True)
        return run_setup(candidate.bench_setup(), args, folder, steps, candidate.fit_arguments())

    def report(trial: Trial, round_number: int) -> None:
        print(progress_line(trial, round_number, time.monotonic() - started), flush=True)

    search = Search(
        measure, plan, args.steps, args.budget_minutes * 60, args.loss_tolerance, args.compile_backend, report
    )
    print(f"tune: {args.config}, {len(args.setup_list)} setups, {args.steps} steps in round 1; logs in {workdir}/")
    print(tune_output.plan_line(plan), flush=True)
    candidates, (micro_batch, accumulation) = add_planned_candidates(search, args, plan)
    if plan.untraceable:
        print(f"memory plan: the recipe's step could not be traced ({plan.untraceable}); nothing is pruned")
    search.try_in_order(candidates)
    search.try_compile()
    search.try_larger_micro_batches(micro_batch, accumulation)
    winner = search.halve()
    elapsed = time.monotonic() - started
    trials = list(search.trials.values())
    stopped = f"; halving stopped early: {search.halving_stopped}" if search.halving_stopped else ""
    print(f"tune took {elapsed / 60:.1f} min{stopped}")
    tune_output.write_plot(trials, workdir / "tune.png")
    if args.json:
        write_json(Path(args.json), tune_output.json_document(args, plan, trials, winner, elapsed))
        print(f"wrote {args.json}")
    if winner is None:
        print("tune: no candidate trained and passed; no recipe written (the lines above say why)", file=sys.stderr)
        return 1
    output = Path(args.output)
    tune_output.write_winner(output, args, trials, winner, argv)
    print(f"winner: {winner.candidate.name} ({tune_output.numbers(winner.rounds[-1])})")
    if winner.guard:
        print(f"  its loss guard: {winner.guard}")
    print(f"wrote {output}; train it with: lightning-fastdist fit --config {output}")
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with sigterm_ends_the_command():  # the trial running is ended with everything it started
        return run(args, argv)
