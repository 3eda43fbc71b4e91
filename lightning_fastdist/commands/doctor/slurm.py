"""What ``doctor`` says inside a SLURM allocation (in a batch script, ``salloc``'s shell or an ``srun`` task): the
allocation as SLURM's variables give it, and whether a recipe run there by ``srun`` (``train.sbatch``) fits it.

The recipe's ``num_nodes`` and numeric ``devices`` are compared as ``lightning-fastdist fit`` compares them (and
refuses a mismatch); beyond that, what makes a run slow or fail there: GPUs for an accelerator that needs them, one
process per GPU, and CPUs for the data-loader workers.
"""

from __future__ import annotations

from lightning_fastdist.diagnostics.slurm_allocation import SlurmAllocation, launch_mismatches
from lightning_fastdist.recipes.recipe import Recipe

_GPU_ACCELERATORS = ("gpu", "cuda")


def recipe_findings(allocation: SlurmAllocation, recipe: Recipe) -> list[str]:
    """Each way ``recipe`` does not fit ``allocation``, one line naming both values; empty when it fits."""
    trainer = recipe.trainer
    nodes = recipe.nodes if recipe.nodes is not None else allocation.nodes
    per_node = allocation.uniform_tasks_per_node
    devices = recipe.devices if recipe.devices is not None else per_node or 1
    findings = launch_mismatches(allocation, nodes, devices)
    accelerator = str(trainer.get("accelerator", "auto"))
    gpus = allocation.gpus_per_node
    if gpus == 0 and accelerator in _GPU_ACCELERATORS:
        findings.append(
            f"trainer.accelerator is {accelerator} but the allocation has no GPUs (--gpus-per-node=0); submit with "
            "--gpus-per-node=N, or pass --trainer.accelerator cpu"
        )
    elif gpus == 0 and accelerator == "auto":
        findings.append(
            "the allocation has no GPUs: trainer.accelerator auto trains on CPU processes over gloo; say so with "
            "--trainer.accelerator cpu (and --trainer.strategy.init_args.compile false: inductor compiles each "
            "block for seconds on a CPU)"
        )
    elif gpus and per_node is not None and per_node != gpus:
        findings.append(
            f"SLURM runs {per_node} task(s) per node on {gpus} GPU(s) per node: Lightning trains one process per GPU; "
            f"submit with --ntasks-per-node={gpus}"
        )
    workers = recipe.section("data")["init_args"].get("num_workers")
    cpus = allocation.cpus_per_task or 1
    if isinstance(workers, int) and workers >= cpus:
        findings.append(
            f"data.num_workers is {workers} loader process(es) per task but SLURM gives each task {cpus} CPU(s) "
            f"(--cpus-per-task); submit with --cpus-per-task={workers + 1}, or pass --data.num_workers {cpus - 1}"
        )
    return findings


def format_allocation(allocation: SlurmAllocation, recipe: Recipe | None, recipe_name: str | None) -> str:
    """The allocation, and (with a recipe) whether the recipe fits it: the ``SLURM allocation`` part of the report."""
    lines = ["SLURM allocation", f"  {allocation.describe()}"]
    if recipe is not None:
        findings = recipe_findings(allocation, recipe)
        if findings:
            lines.append(f"  recipe {recipe_name} does not fit it:")
            lines += [f"    - {finding}" for finding in findings]
        else:
            lines.append(f"  recipe {recipe_name} fits it")
    return "\n".join(lines)
