"""What ``lightning-fastdist tune`` writes: the winning recipe, the JSON of every candidate, the plot. Each carries
tune's mark (the recipe's first line, the JSON's ``written_by``, a marker file in the work folder), and tune
replaces only marked files: anything else at those paths is refused before a trial starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_fastdist.commands.bench.plot import ENGINE_COLOURS
from lightning_fastdist.commands.bench.rows import throughput
from lightning_fastdist.commands.tune.candidates import MemoryPlan, readable_bytes
from lightning_fastdist.commands.tune.search import Trial
from lightning_fastdist.commands.written_marks import (
    first_line_starts_with,
    folder_refusal,
    json_written_by,
    refusal,
    write_recipe,
)
from lightning_fastdist.recipes.recipe import Recipe

WRITTEN_BY = "lightning-fastdist tune"
RECIPE_HEADER = f"# Written by: {WRITTEN_BY}"


def outputs_not_ours(output: Path, json_path: Path | None, workdir: Path) -> list[str]:
    """One line per output path that holds something tune did not write (so it would not be replaced)."""
    recipe_ours, json_ours = (
        lambda p: first_line_starts_with(p, RECIPE_HEADER),
        lambda p: json_written_by(p) == WRITTEN_BY,
    )
    problems = [
        refusal("--output", output, "tuned.yaml", recipe_ours, "tune", "give another path"),
        json_path and refusal("--json", json_path, "tune.json", json_ours, "tune", "give another path"),
    ]
    problems.append(folder_refusal("--workdir", workdir, "tune"))
    return [problem for problem in problems if problem]


def plan_line(plan: MemoryPlan) -> str:
    if plan.usable_bytes is None:
        return "memory plan: none (no GPU visible and no --gpu-memory): nothing is pruned"
    return (
        f"memory plan: {readable_bytes(plan.usable_bytes)} usable per device, world {plan.world_size} "
        f"({plan.gpus_per_node} per node): candidates that do not fit are never started"
    )


def numbers(row: dict) -> str:
    """A measured row in one line."""
    unit = "tokens" if row.get("tokens_per_s") else "samples"
    exposed, held_out = row.get("exposed_comm_s"), row.get("held_out_loss")
    return (
        f"{row['steps']} steps  {throughput(row):,.0f} {unit}/s  "
        f"exposed {'n/a' if exposed is None else f'{1000 * exposed:.1f} ms'}  "
        f"peak {row['peak_memory_bytes_max_rank'] / 2**20:.0f} MiB  tail loss {row['tail_loss']:.4f}"
        + ("" if held_out is None else f"  held-out loss {held_out:.4f}")
    )


def table(trials: list[Trial]) -> list[str]:
    """The candidates, round 1 and last round (tokens/s; round 1's losses), as the recipe's comment lines."""
    columns = f"{'round 1':>12} {'last round':>17} {'tail loss':>9} {'held-out':>9}"
    lines = [f"{'candidate':<32} {'status':<9} {columns}  why"]
    for trial in trials:
        first = trial.rounds[0] if trial.rounds else None
        last = trial.rounds[-1] if len(trial.rounds) > 1 else None
        held_out = first.get("held_out_loss") if first else None
        cells = [
            f"{trial.candidate.name:<32}",
            f"{trial.status:<9}",
            f"{throughput(first):>12,.0f}" if first else f"{'':>12}",
            f"{throughput(last):>9,.0f} (r{last['round']})" if last else f"{'':>17}",
            f"{first['tail_loss']:>9.4f}" if first else f"{'':>9}",
            f"{held_out:>9.4f}" if held_out is not None else f"{'':>9}",
            f" {trial.reason}" if trial.reason else "",
        ]
        lines.append(" ".join(cells).rstrip())
    return lines


def tuned_recipe(recipe: Recipe, winner: Trial, devices: str | None = None, nodes: int | None = None) -> dict:
    """The user's recipe with the winner's strategy and batch split, and the ``devices`` and ``nodes`` it was
    tuned on where they were given; model and data otherwise unchanged."""
    candidate = winner.candidate
    tuned = recipe.with_strategy(candidate.bench_setup().strategy_config(world_size=None))
    if candidate.micro_batch is not None:
        tuned["trainer"]["accumulate_grad_batches"] = candidate.accumulation
        tuned.setdefault("data", {}).setdefault("init_args", {})["batch_size"] = candidate.micro_batch
    if devices is not None:
        tuned["trainer"]["devices"] = int(devices) if str(devices).isdigit() else devices
    if nodes is not None:
        tuned["trainer"]["num_nodes"] = nodes
    return tuned


def write_winner(path: Path, args: argparse.Namespace, trials: list[Trial], winner: Trial, argv: list[str]) -> None:
    """The user's recipe with the winner's setup, under the measured table as comments."""
    unit = "tokens" if winner.rounds[-1].get("tokens_per_s") else "samples"
    header = [
        " ".join([RECIPE_HEADER, *argv]),
        f"# Winner: {winner.candidate.name}, the fastest that passed the loss guard, of "
        f"{sum(bool(t.rounds) for t in trials)} measured ({unit}/s over all ranks, per round):",
        *(f"#   {line}" for line in table(trials)),
    ]
    write_recipe(path, header, tuned_recipe(args.recipe, winner, args.devices, args.nodes))


def json_document(
    args: argparse.Namespace, plan: MemoryPlan, trials: list[Trial], winner: Trial | None, elapsed_s: float
) -> dict:
    return {
        "written_by": WRITTEN_BY,
        "config": args.config,
        "elapsed_s": elapsed_s,
        "budget_s": args.budget_minutes * 60,
        "loss_tolerance": args.loss_tolerance,
        "memory_plan": {"usable_bytes": plan.usable_bytes, "untraceable": plan.untraceable},
        "winner": winner.candidate.name if winner else None,
        "candidates": [
            {
                "name": t.candidate.name,
                "status": t.status,
                "reason": t.reason,
                "compared_with": t.candidate.compared_with,
                "guard": t.guard,
                "strategy": t.candidate.bench_setup().strategy_config(world_size=None),
                "micro_batch": t.candidate.micro_batch,
                "accumulation": t.candidate.accumulation,
                "peak_plan_bytes": t.peak_plan_bytes,
                "rounds": t.rounds,
            }
            for t in trials
        ],
    }


def write_plot(trials: list[Trial], path: Path) -> None:
    """Round-1 throughput per measured candidate, coloured by engine; the winner's bar outlined thick."""
    import matplotlib  # noqa: PLC0415 - only the commands that plot need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    measured = [t for t in trials if t.rounds]
    figure, axis = plt.subplots(figsize=(9, 0.9 + 0.35 * max(len(measured), 4)))
    axis.barh(
        [t.candidate.name for t in measured],
        [throughput(t.rounds[0]) for t in measured],
        color=[ENGINE_COLOURS[t.candidate.setup.engine] for t in measured],
        edgecolor="black",
        linewidth=[3 if t.status == "winner" else 0.5 for t in measured],
        hatch=["xx" if t.status == "rejected" else "" for t in measured],
    )
    unit = "tokens" if all(t.rounds[0].get("tokens_per_s") for t in measured) else "samples"
    axis.set_xlabel(f"{unit} / s in round 1 (all ranks); thick edge: the winner; crossed: rejected by the loss guard")
    axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
