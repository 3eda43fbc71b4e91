"""Every packaged recipe parses with the CLI; the CPU-runnable ones train a few steps; multi-node on loopback."""

from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fastdist.cli import main
from lightning_fastdist.recipes import available_recipes, recipes_dir
from tests.support.emulated_cluster import REPO_ROOT
from tests.support.fault_runs import saved_step
from tests.support.harness import ForkedModule, cli_command, free_port_span, run_cli_forked, run_processes
from tests.support.node_faults import start_again_once_held

# A tiny model for multi_node's loopback run: seconds on a CPU, eager "compile", no validation.
TINY = [
    "--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
    "--data.block_size", "32", "--data.batch_size", "4", "--data.num_workers", "0",
    "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2", "--trainer.limit_val_batches", "0",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip
EAGER_COMPILE = ["--trainer.strategy.init_args.compile", "{backend: eager}"]
# What a 2-core CPU needs to run a recipe's own workload (its data, batch, sequence length, strategy,
# precision, accumulation and callbacks) in seconds: CPU processes, a narrow model, no loader workers,
# eager instead of inductor, validation and a checkpoint after every optimizer step, every step logged.
# The two ranks are forked with torchrun's environment from the suite's server, which imported everything once (the
# CLI's own start-up is test_cli's).
CPU_OVERRIDES = [
    "--trainer.accelerator", "cpu", "--trainer.devices", "2",
    "--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--data.num_workers", "0",
    "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
    "--trainer.callbacks.init_args.every_n_train_steps", "1",  # the recipe's ModelCheckpoint is its last callback
]  # fmt: skip
RECIPE_CPU_OVERRIDES = {
    "cpu_smoke": [],
    "single_node": EAGER_COMPILE,
    "large_model": [],
    "large_model_deepspeed": [],
}
RECIPES = (
    "cpu_smoke", "single_node", "large_model", "large_model_deepspeed", "multi_node", "multi_node_ethernet",
    "multi_node_fault_tolerant",
)  # fmt: skip
# The quick-start recipe resumes through the CLI; each engine's resume is held bitwise by its own tests
# (test_exact_resume, test_fsdp_checkpoint, test_deepspeed). The multi-node ones train on two loopback nodes below.
RESUMED = ("cpu_smoke",)


def test_the_documented_recipes_are_packaged():
    assert set(RECIPES) <= set(available_recipes())
    sbatch = (recipes_dir() / "slurm" / "train.sbatch").read_text()
    assert "srun --no-kill lightning-fastdist fit --config multi_node" in sbatch


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


def metrics(log_root: Path, version: str = "version_*") -> list[dict[str, str]]:
    (log_file,) = log_root.glob(f"*/{version}/metrics.csv")
    with open(log_file) as handle:
        return list(csv.DictReader(handle))


def test_every_recipe_has_a_finite_timeout_and_a_fixed_checkpoint_folder():
    for name in RECIPES:
        trainer = yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text())["trainer"]
        assert 0 < trainer["strategy"]["init_args"]["timeout"] < float("inf"), name
        (checkpoint,) = [c for c in trainer["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
        assert checkpoint["init_args"]["dirpath"] == f"checkpoints/{name}", name
        assert trainer["check_val_every_n_epoch"] is None, name  # val_check_interval may exceed an epoch


def accumulation(name: str) -> int:
    return yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text())["trainer"].get("accumulate_grad_batches", 1)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(RECIPE_CPU_OVERRIDES))
def test_recipe_runs_its_workload_through_validation_and_resumes_with_ckpt_path_last(name, in_tmp_dir):
    batches_per_step = accumulation(name)
    overrides = [*CPU_OVERRIDES, *RECIPE_CPU_OVERRIDES[name], "--trainer.val_check_interval", str(batches_per_step)]
    run_cli_forked(["fit", "--config", name, *overrides, "--trainer.max_steps", "2"], timeout=240)
    last = in_tmp_dir / "checkpoints" / name / "last.ckpt"
    assert saved_step(last) == 2
    first = metrics(in_tmp_dir / "lightning_logs", "version_0")
    assert [int(r["step"]) for r in first if r["val_loss"]] == [0, 1]  # validated after each optimizer step
    if name not in RESUMED:
        return
    resume = ["fit", "--config", name, *overrides, "--trainer.max_steps", "4", "--ckpt_path", "last"]
    run_cli_forked(resume, timeout=240)
    assert saved_step(last) == 4
    second = metrics(in_tmp_dir / "lightning_logs", "version_1")
    assert sorted({int(r["step"]) for r in second if r["train_loss"]}) == [2, 3]  # continued at step 2


def fit_on_two_loopback_nodes(config: str, *options: str) -> list[dict[str, str]]:
    """Run ``config`` (the tiny workload, eager compile, CPU) under torchrun on two loopback nodes of one rank each;
    return the metrics rank 0 logged."""
    port = str(free_port_span(3))  # torchrun's store; the node stores at +1 (the register) and +2
    nodes = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
         *cli_command("fit", "--config", config, *TINY, *EAGER_COMPILE, "--trainer.accelerator", "cpu",
                      "--trainer.devices", "1", "--trainer.num_nodes", "2", *options)]
        for rank in range(2)
    ]  # fmt: skip
    outputs = run_processes(nodes, timeout=240)
    log = "".join(o.stdout + o.stderr for o in outputs)
    assert "[rank: 1] Seed set to 1234" in log  # the second node's process took part
    return metrics(Path("lightning_logs"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multi_node_recipe_on_two_loopback_nodes(in_tmp_dir):
    rows = fit_on_two_loopback_nodes("multi_node", "--trainer.strategy.init_args.powersgd_start_iter", "2")
    step_bytes = [float(r["comm/allreduce_bytes_per_step"]) for r in rows if r.get("comm/allreduce_bytes_per_step")]
    assert step_bytes and step_bytes[-1] < step_bytes[0]  # PowerSGD compressed after its start step


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multi_node_ethernet_recipe_syncs_across_two_loopback_nodes_under_torchrun(in_tmp_dir):
    outer_sync = "{every: 2, fragments: 2, delay: 0}"  # the tiny model's 2 blocks; a fragment crosses every step
    rows = fit_on_two_loopback_nodes(
        "multi_node_ethernet",
        "--trainer.strategy.init_args.outer_sync", outer_sync,
        "--trainer.callbacks.init_args.every_n_train_steps", "2",
    )  # fmt: skip
    outer = [
        float(r["comm/outer_allreduce_bytes_per_step"]) for r in rows if r.get("comm/outer_allreduce_bytes_per_step")
    ]
    assert outer and all(count > 0 for count in outer)  # a fragment's bf16 pseudo-gradient on every logged step
    (node_files,) = (in_tmp_dir / "checkpoints" / "multi_node_ethernet").glob("*step=4.ckpt.outer_sync/step000000004")
    assert sorted(p.name for p in node_files.iterdir()) == ["node00000.pt", "node00001.pt"]


def lose_node_1_and_start_it_again(config: str, *options: str, **faults: str) -> tuple[list[tuple[str, str]], int]:
    """Fit ``config`` for 16 steps on two loopback nodes (Lightning's launcher): node 1 is SIGKILLed after step 4 (or
    where ``faults`` say), node 0 trains on alone and waits after step 8 until node 1, started again with the same
    command, trains. Returns each node's ``(stdout, stderr)`` (node 1's of its second start, then of its first) and the
    step after which node 1 came back."""
    started = Path("started").resolve()
    command = [
        sys.executable, "-m", "lightning_fastdist.cli", "fit", "--config", config, *TINY, *EAGER_COMPILE,
        "--trainer.accelerator", "cpu",
        "--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.max_steps", "16",
        "--trainer.log_every_n_steps", "1", "--trainer.callbacks+=tests.support.node_faults.NodeFaults", *options,
    ]  # fmt: skip
    port = str(free_port_span(4))
    environments = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "PYTHONPATH": str(REPO_ROOT),
         "NODE_FAULT_KILL": "1:4", "NODE_FAULT_HOLD": f"8:{started}", **faults}
        for node in range(2)
    ]  # fmt: skip
    nodes = [ForkedModule(command, {**os.environ, **extra}) for extra in environments]  # no start-up of their own
    lost = nodes[1]
    nodes[1] = start_again_once_held(lost, command, environments[1], started, start=ForkedModule)
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    came_back = int(re.search(r"node1 rejoined the job at step (\d+) .* of node0", outputs[1][1]).group(1))
    return [*outputs, lost.communicate()], came_back


def logged_ranks() -> dict[int, float]:
    """``speed/ranks`` by logged step (Lightning names step k's values k - 1)."""
    return {
        int(row["step"]): float(row["speed/ranks"]) for row in metrics(Path("lightning_logs")) if row.get("speed/ranks")
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multi_node_ethernet_recipe_trains_on_without_a_lost_node_and_takes_it_back(in_tmp_dir):
    """The recipe's ``min_nodes: 1``: node 1 joins at a later sync with node 0's state, and rank 0's ``speed/ranks``
    says 2, then 1, then 2."""
    outputs, came_back = lose_node_1_and_start_it_again(
        "multi_node_ethernet", "--trainer.strategy.init_args.outer_sync.every", "2",
        "--trainer.strategy.init_args.outer_sync.delay", "0",
    )  # fmt: skip
    # A fragment crosses at every step (2 fragments every 2 steps): step 5's quorum is the first without node 1.
    assert "outer_sync: node1 left the job at step 5" in outputs[0][1]
    assert f"outer_sync: node1 came back at step {came_back} (restarted): 2 of 2 nodes train on." in outputs[0][1]
    # The ranks of the nodes in each step's quorum.
    assert logged_ranks() == {step - 1: 1.0 if 5 <= step < came_back else 2.0 for step in range(1, 17)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multi_node_fault_tolerant_recipe_trains_on_while_a_preempted_node_is_away_and_takes_it_back(in_tmp_dir):
    """The recipe's ``replica_groups: {min_nodes: 1}``: node 1 is sent SIGTERM after step 4 (preempted alone): it stops
    with exit status 143, writing nothing and reducing nothing with node 0; node 0 trains on alone from step 5 and no
    step is lost. Node 1, started again, takes node 0's state at the quorum of a later step and trains on with it;
    rank 0's ``speed/ranks`` says 2, then 1, then 2. (A node SIGKILLed during a step: tests/replica_groups.)"""
    outputs, came_back = lose_node_1_and_start_it_again("multi_node_fault_tolerant", NODE_FAULT_KILL_SIGNAL="SIGTERM")
    survivor, preempted = outputs[0][1], outputs[2][1]
    assert (
        "[rank 1] stopped by SIGTERM after step 4: this node writes no checkpoint (another node writes the job's)"
        in preempted
    )
    assert "replica_groups: node1 left the job at step 4" in survivor and "is not applied" not in survivor
    assert f"replica_groups: node1 came back at step {came_back} (restarted): 2 of 2 nodes train on." in survivor
    assert logged_ranks() == {step - 1: 1.0 if 5 <= step <= came_back else 2.0 for step in range(1, 17)}
    # Global rank 0's at the end of its fit; node 1's stop wrote nothing (it would be step 4's).
    assert [saved_step(path) for path in Path("checkpoints").rglob("*.ckpt")] == [16]
