"""Every packaged recipe parses with the CLI; the CPU-runnable ones train a few steps; multi-node on loopback."""

from __future__ import annotations

import csv
import sys

import pytest
import yaml

from lightning_fastdist.cli import main
from lightning_fastdist.recipes import available_recipes, recipes_dir
from tests.harness import cli_command, free_port, run_launcher, run_processes

# Shrinks any recipe to a seconds-long CPU run: a 2-layer model, 4 steps, eager "compile".
TINY = [
    "--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
    "--data.block_size", "32", "--data.batch_size", "4", "--data.num_workers", "0",
    "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2", "--trainer.limit_val_batches", "0",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip
EAGER_COMPILE = ["--trainer.strategy.init_args.compile", "{backend: eager}"]
RECIPES = ("cpu_smoke", "single_node", "large_model", "multi_node")


def test_the_documented_recipes_are_packaged():
    assert set(RECIPES) <= set(available_recipes())
    sbatch = (recipes_dir() / "slurm" / "train.sbatch").read_text()
    assert "srun lightning-fastdist fit --config multi_node" in sbatch


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_and_explains_its_keys(name, in_tmp_dir, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", name, "--print_config"])
    assert stop.value.code == 0
    assert "class_path: lightning_fastdist.demo.TinyGPT" in capsys.readouterr().out
    text = (recipes_dir() / f"{name}.yaml").read_text()
    assert yaml.safe_load(text)["trainer"]
    commented = [line for line in text.splitlines() if "#" in line]
    assert len(commented) >= 5, "a recipe says why it sets what it sets"


def metrics(log_root) -> list[dict[str, str]]:
    (log_file,) = log_root.glob("*/version_*/metrics.csv")
    with open(log_file) as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["single_node", "large_model"])
def test_gpu_recipe_dry_runs_on_cpu(name, in_tmp_dir):
    run_launcher(cli_command("fit", "--config", name, *TINY, *EAGER_COMPILE), timeout=240)
    rows = metrics(in_tmp_dir / "lightning_logs")
    assert any(r.get("train_loss") for r in rows)


@pytest.mark.slow
def test_multi_node_recipe_on_two_loopback_nodes(in_tmp_dir):
    port = str(free_port())
    nodes = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
         *cli_command("fit", "--config", "multi_node", *TINY, *EAGER_COMPILE, "--trainer.accelerator", "cpu",
                      "--trainer.devices", "1", "--trainer.num_nodes", "2",
                      "--trainer.strategy.init_args.powersgd_start_iter", "2")]
        for rank in range(2)
    ]  # fmt: skip
    outputs = run_processes(nodes, timeout=240)
    log = "".join(o.stdout + o.stderr for o in outputs)
    assert "MEMBER: 1/2" in log and "MEMBER: 2/2" in log
    rows = metrics(in_tmp_dir / "lightning_logs")
    step_bytes = [float(r["comm/allreduce_bytes_per_step"]) for r in rows if r.get("comm/allreduce_bytes_per_step")]
    assert step_bytes and step_bytes[-1] < step_bytes[0]  # PowerSGD compressed after its start step
