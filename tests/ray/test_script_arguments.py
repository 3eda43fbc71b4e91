"""The packaged Ray script's arguments (``lightning_fastdist/cli/ray_train.py``), read without Ray: what each worker
runs, Ray's worker count, a recipe file found from the workers' folder. Its run under Ray is in test_ray_train.py."""

from __future__ import annotations

import pytest

from lightning_fastdist.cli.ray_train import RAY_ENVIRONMENT, absolute_configs, parser, worker_command, workers


def test_a_fit_gets_rays_environment_rayreport_and_the_restored_checkpoint_last():
    command = ["fit", "--config", "cpu_smoke", "--ckpt_path", "last"]
    assert worker_command(command, 50, "/storage/checkpoint_1/checkpoint.ckpt") == [
        *command,
        f"--trainer.plugins+={RAY_ENVIRONMENT}",
        "--trainer.callbacks+=lightning_fastdist.RayReport",
        "--trainer.callbacks.every_n_train_steps=50",
        "--ckpt_path=/storage/checkpoint_1/checkpoint.ckpt",  # after the user's: the last one given wins
    ]
    assert worker_command(command, 50, None)[-1] == "--trainer.callbacks.every_n_train_steps=50"


def test_other_commands_get_rays_environment_only():
    assert worker_command(["validate", "--config", "my.yaml"], 50, "/x.ckpt") == [
        "validate",
        "--config",
        "my.yaml",
        f"--trainer.plugins+={RAY_ENVIRONMENT}",
    ]


def test_a_recipe_file_is_made_absolute_and_a_recipe_name_stays(in_tmp_dir):
    (in_tmp_dir / "mine.yaml").write_text("trainer: {}\n")
    command = ["fit", "--config", "mine.yaml", "--config=mine.yaml", "--config", "cpu_smoke"]
    mine = str(in_tmp_dir / "mine.yaml")
    assert absolute_configs(command) == ["fit", "--config", mine, f"--config={mine}", "--config", "cpu_smoke"]


def test_workers_fixed_or_elastic():
    assert workers("4") == 4
    assert workers("2:8") == (2, 8)


def test_ray_options_come_before_the_command():
    args = parser().parse_args(["--workers", "2:4", "--report-every", "10", "fit", "--trainer.max_steps", "5"])
    assert (args.workers, args.report_every) == ("2:4", 10)
    assert args.command == ["fit", "--trainer.max_steps", "5"]
    with pytest.raises(SystemExit):
        parser().parse_args(["--workers"])
