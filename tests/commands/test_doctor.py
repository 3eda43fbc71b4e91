"""``lightning-fastdist doctor``.

Environment, memory table, recommendation, one-line errors, and a recipe that trains.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lightning_fastdist.commands.doctor.command import main
from lightning_fastdist.commands.doctor.demo_model import demo_model_shape
from lightning_fastdist.demo import TinyGPT
from lightning_fastdist.diagnostics.environment import detect_environment
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.advisor import Target, build_recipe, recommend
from lightning_fastdist.planning.comm_model import estimate_comm
from lightning_fastdist.planning.memory_model import GiB, TrainingShape, estimate_memory
from tests.support.harness import run_cli_forked


def recipe_at(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_environment_is_read_without_failing():
    env = detect_environment()
    assert env.torch_version and env.lightning_version and env.cpu_cores >= 1
    assert "gloo" in env.backends
    assert env.as_dict()["gpus"] == [
        {"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes, "bf16": g.bf16} for g in env.gpus
    ]


@pytest.mark.parametrize("parameters", [200_000, 10**6, 124 * 10**6, 7 * 10**9])
def test_demo_model_is_sized_to_the_requested_parameters(parameters):
    layers, hidden, heads = demo_model_shape(parameters, seq_len=128)
    assert hidden % heads == 0
    if parameters <= 10**6:  # small enough to build and count
        built = TinyGPT(n_layer=layers, n_embd=hidden, n_head=heads, block_size=128).num_parameters()
        assert built == pytest.approx(parameters, rel=0.15)
    estimated = 12 * layers * hidden**2 + (13 * layers + 256 + 128 + 2) * hidden
    assert estimated == pytest.approx(parameters, rel=0.15)
    assert demo_model_shape(parameters, 128, layers=3, hidden=48) == (3, 48, 3)


def test_recommendation_moves_from_ddp_to_sharding_to_smaller_micro_batches():
    eight_h100 = Target("gpu", devices=8, device_memory_bytes=80 * GiB, bf16=True, cpu_cores=64)
    small = recommend(TrainingShape(125 * 10**6, 12, 768, 1024, 8), eight_h100)
    assert (small.estimate.mode, small.estimate.activation_checkpointing, small.fits) == ("ddp", "none", True)
    assert small.shape.precision == "bf16-mixed"
    big = recommend(TrainingShape(7 * 10**9, 32, 4096, 2048, 4), eight_h100)
    assert big.fits and big.estimate.mode in ("zero2", "zero3")
    huge = recommend(TrainingShape(70 * 10**9, 80, 8192, 4096, 8), eight_h100, global_batch=64)
    assert huge.shape.micro_batch < 8 and huge.accumulate_grad_batches * huge.shape.micro_batch * 8 == 64
    v100 = Target("gpu", devices=1, device_memory_bytes=16 * GiB, bf16=False, cpu_cores=8)
    assert recommend(TrainingShape(10**6, 2, 128, 128, 8), v100).shape.precision == "16-mixed"


def test_deepspeed_zero_offload_is_chosen_when_only_offloading_fits_and_its_recipe_sets_the_precision():
    # 3B parameters on two 24 GiB GPUs: FSDP ZeRO-3 holds 16 bytes / 2 per parameter (24 GB) even with
    # checkpointing; DeepSpeed's ZeRO-2 with the optimizer offloaded holds bf16 weights and a gradient shard.
    two_gpus = Target("gpu", devices=2, device_memory_bytes=24 * GiB, bf16=True, cpu_cores=16)
    choice = recommend(TrainingShape(3 * 10**9, 32, 2560, 2048, 1), two_gpus)
    assert (choice.estimate.mode, choice.estimate.activation_checkpointing, choice.estimate.cpu_offload) == (
        "ds-zero2", "none", True,
    )  # fmt: skip
    assert "DeepSpeed ZeRO-2 + optimizer offload: the fastest option" in choice.reasons[1]
    recipe = build_recipe(choice, two_gpus, {"class_path": "m.M"}, {"class_path": "d.D"}, max_steps=10)
    strategy = recipe["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_fastdist.FastDeepSpeedStrategy"
    assert strategy["init_args"] == {
        "stage": 2, "activation_checkpointing": "none", "offload_optimizer": True, "offload_parameters": False,
    }  # fmt: skip
    assert recipe["trainer"]["precision"] == "bf16-mixed" and "plugins" not in recipe["trainer"]  # DeepSpeed's own bf16


def test_replica_groups_keep_to_ddp_and_fsdp_shard_inside_a_node_and_count_the_gradients_kept_between_steps():
    two_nodes = Target("gpu", devices=8, device_memory_bytes=80 * GiB, bf16=True, cpu_cores=64, nodes=2)
    shape = TrainingShape(7 * 10**9, 32, 4096, 2048, 4)
    choice = recommend(shape, two_nodes, replica_groups=ReplicaGroups(min_nodes=1))
    chosen = choice.estimate
    assert chosen.mode in ("ddp", "zero2", "zero3") and choice.fits
    per_node = replace(choice.shape, world_size=8)  # each node a world of its own: FSDP shards over its 8 GPUs
    setup = (chosen.mode, chosen.activation_checkpointing, chosen.cpu_offload)
    assert chosen == estimate_memory(per_node, *setup, kept_gradient_copy=True)
    assert chosen.gradients == 2 * estimate_memory(per_node, *setup).gradients
    assert choice.reasons[1].startswith("replica_groups (the recipe's, min_nodes 1): each node a torchft replica")
    recipe = build_recipe(choice, two_nodes, {"class_path": "m.M"}, {"class_path": "d.D"}, max_steps=10)
    assert recipe["trainer"]["strategy"]["init_args"]["replica_groups"] == {"min_nodes": 1}
    # Where only DeepSpeed's ZeRO-Offload fits one world, replica_groups never gets DeepSpeed (it cannot take them).
    small_gpus = Target("gpu", devices=2, device_memory_bytes=24 * GiB, bf16=True, cpu_cores=16, nodes=2)
    frugal = recommend(TrainingShape(3 * 10**9, 32, 2560, 2048, 1), small_gpus, replica_groups=ReplicaGroups(1))
    assert frugal.estimate.mode in ("ddp", "zero2", "zero3")


def test_doctor_keeps_a_recipes_replica_groups_on_its_nodes_and_refuses_what_cannot_take_them(in_tmp_dir, capsys):
    plan = ["--config", "multi_node_fault_tolerant", "--gpus", "8", "--gpu-memory", "80"]
    assert main([*plan, "--output", "ft.yaml"]) == 0
    trainer = recipe_at(in_tmp_dir / "ft.yaml")["trainer"]
    assert trainer["num_nodes"] == 2  # the recipe's
    assert trainer["strategy"]["init_args"]["replica_groups"] == {"min_nodes": 1}
    assert "replica_groups (the recipe's, min_nodes 1)" in capsys.readouterr().out
    assert main([*plan, "--nodes", "1", "--output", "one.yaml"]) == 2
    assert main([*plan, "--simulate", "--world-size", "8", "--output", "simulated.yaml"]) == 2  # one node of 8
    errors = capsys.readouterr().err.splitlines()
    assert "--nodes: the recipe's replica_groups synchronises across nodes and this job has --nodes=1" in errors[0]
    assert errors[2] == errors[0]
    assert not (in_tmp_dir / "one.yaml").exists() and not (in_tmp_dir / "simulated.yaml").exists()


def test_planning_for_gpus_from_a_cpu_machine_writes_a_gpu_recipe(in_tmp_dir, capsys):
    args = [
        "--params",
        "13B",
        "--seq-len",
        "2048",
        "--micro-batch",
        "4",
        "--gpus",
        "8",
        "--gpu-memory",
        "80",
        "--output",
        "plan.yaml",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for expected in (
        "Environment",
        "torch.distributed backends:",
        "CPU cores:",
        "NVLink:",
        "zero3    full",
        "ds-zero2 full",
        "Wrote plan.yaml",
    ):
        assert expected in printed
    ddp_row = next(line for line in printed.splitlines() if line.lstrip().startswith("ddp      none"))
    sent = estimate_comm(
        TrainingShape(13 * 10**9, 1, 1, 2048, 4, world_size=8, precision="bf16-mixed"), "ddp"
    )  # N, W, precision
    assert ddp_row.endswith(f"{sent.sent_per_device / 2**30:9.3f}G")  # the sent/step column
    recipe = recipe_at(in_tmp_dir / "plan.yaml")
    assert recipe["trainer"]["accelerator"] == "gpu" and recipe["trainer"]["devices"] == 8
    assert recipe["trainer"]["strategy"]["class_path"] == "lightning_fastdist.FastFSDPStrategy"
    assert recipe["trainer"]["plugins"][0]["init_args"] == {"precision": "bf16-mixed", "device": "cuda"}
    assert recipe["model"]["init_args"]["block_size"] == 2048 == recipe["data"]["init_args"]["block_size"]
    assert "# Estimated peak per device:" in (in_tmp_dir / "plan.yaml").read_text()


def test_a_recipe_config_supplies_the_model_and_batch(in_tmp_dir, capsys):
    assert main(["--config", "cpu_smoke", "--output", "smoke.yaml"]) == 0
    printed = capsys.readouterr().out
    parameters = TinyGPT(n_layer=4, n_head=4, n_embd=128, block_size=128).num_parameters()
    assert f"N={parameters:,} parameters, 4 layers x 128 wide, seq 128, micro-batch 16" in printed
    recipe = recipe_at(in_tmp_dir / "smoke.yaml")
    assert recipe["model"]["init_args"]["n_embd"] == 128 and recipe["data"]["init_args"]["batch_size"] == 16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seq-len", "x"], "argument --seq-len: must be an integer >= 1, got 'x'"),
        (["--gpus", "0"], "argument --gpus: must be an integer >= 1, got '0'"),
        (["--params", "lots"], "argument --params: must be a parameter count >= 1 such as 836352, 124M, 1.3B or 7e9"),
        (["--gpu-memory", "-1"], "argument --gpu-memory: must be a finite number > 0, got '-1'"),
        (["--gpu-memory", "inf"], "argument --gpu-memory: must be a finite number > 0, got 'inf'"),
        (["--config", "nope"], "--config: recipe 'nope' not found; give a YAML path or one of: "),
        (["--global-batch", "7"], "--global-batch: global_batch must be a positive multiple of micro_batch x devices"),
        (["--colour"], "unrecognized arguments: --colour"),
    ],
)
def test_bad_flags_give_one_line_naming_the_flag(args, message, in_tmp_dir, capsys):
    assert main([*args, "--output", "x.yaml"]) == 2
    error = capsys.readouterr().err.splitlines()
    assert error[0].startswith("lightning-fastdist doctor: error: ") and message in error[0], error
    assert error[1:] == ["Run 'lightning-fastdist doctor --help'."]
    assert not (in_tmp_dir / "x.yaml").exists()


def test_output_replaces_only_a_recipe_doctor_wrote(in_tmp_dir, capsys):
    assert main(["--config", "cpu_smoke", "--output", "plan.yaml"]) == 0
    assert main(["--config", "cpu_smoke", "--output", "plan.yaml", "--max-steps", "7"]) == 0
    assert recipe_at(in_tmp_dir / "plan.yaml")["trainer"]["max_steps"] == 7
    users_file = in_tmp_dir / "mine.yaml"
    users_file.write_text("# my own notes\ntrainer: {}\n")
    (in_tmp_dir / "folder").mkdir()
    capsys.readouterr()
    assert main(["--config", "cpu_smoke", "--output", "mine.yaml"]) == 2
    assert main(["--config", "cpu_smoke", "--output", "folder"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert "--output: mine.yaml exists and was not written by doctor, so it is kept" in errors[0]
    assert "--output: folder is a folder; give a file path" in errors[2]
    assert users_file.read_text() == "# my own notes\ntrainer: {}\n" and not any((in_tmp_dir / "folder").iterdir())


def test_gpus_without_memory_on_a_machine_without_gpus_is_refused(in_tmp_dir, capsys):
    if detect_environment().gpus:
        pytest.skip("this machine has GPUs: their memory is read")
    assert main(["--gpus", "4"]) == 2
    assert "--gpu-memory: needed with --gpus when no GPU is visible" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_written_recipe_trains_with_lightning_fastdist_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--params", "200K", "--seq-len", "32", "--micro-batch", "4", "--max-steps", "3", "--output", "doctor.yaml"]
    assert main(argv) == 0
    assert "Wrote doctor.yaml" in capsys.readouterr().out
    recipe = recipe_at(tmp_path / "doctor.yaml")
    assert recipe["trainer"]["accelerator"] == "cpu" and recipe["trainer"]["max_steps"] == 3
    # 2 ranks (the recipe's devices on this CPU machine) with torchrun's environment, forked without a start-up of
    # their own: what is checked is the recipe, not the launch (Lightning's launch and torchrun's: test_cli.py).
    fit = ["fit", "--config", "doctor.yaml", "--trainer.log_every_n_steps", "1"]
    rank0, _ = run_cli_forked(fit, cwd=tmp_path, timeout=240)
    assert "lightning-fastdist: finished at step 3: train_loss " in rank0.stdout
    run_dir = tmp_path / "lightning_logs" / "doctor" / "version_0"
    assert (run_dir / "checkpoints" / "epoch=0-step=3.ckpt").is_file()
    assert "train_loss" in (run_dir / "metrics.csv").read_text()
