"""The lightning-fastdist command: defaults, recipes, one-line errors, and real 2-process runs."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

from lightning_fastdist.cli import main
from lightning_fastdist.recipes import available_recipes, find_recipe, recipes_dir
from tests.harness import cli_command, run_cli, run_launcher


def run_main_expecting_usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 2
    stderr = capsys.readouterr().err
    error_lines = [line for line in stderr.splitlines() if line.startswith("lightning-fastdist: error:")]
    assert len(error_lines) == 1, stderr
    assert "usage:" not in stderr  # one message, not the whole option list
    return error_lines[0]


# ---------------------------------------------------------------- recipes


def test_packaged_recipes_resolve_by_name_path_or_recipes_prefix(in_tmp_dir):
    assert "cpu_smoke" in available_recipes()
    packaged = recipes_dir() / "cpu_smoke.yaml"
    for reference in ("cpu_smoke", "cpu_smoke.yaml", "recipes/cpu_smoke.yaml"):
        assert find_recipe(reference) == packaged
    assert find_recipe("elsewhere/cpu_smoke.yaml") is None
    assert find_recipe("no_such_recipe") is None


def test_a_local_file_wins_over_a_packaged_recipe(in_tmp_dir):
    local = in_tmp_dir / "cpu_smoke.yaml"
    local.write_text("trainer: {max_steps: 1}\n")
    assert find_recipe("cpu_smoke.yaml") == Path("cpu_smoke.yaml")


def test_console_script_lists_recipes_from_any_directory(in_tmp_dir):
    listing = subprocess.run(cli_command("recipes"), capture_output=True, text=True, check=True)
    assert "cpu_smoke" in listing.stdout


def test_print_config_defaults_to_the_demo_workload(in_tmp_dir, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--print_config"])
    assert stop.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: lightning_fastdist.demo.TinyGPT" in printed
    assert "class_path: lightning_fastdist.demo.TextDataModule" in printed


def test_print_config_of_the_recipe_applies_overrides(in_tmp_dir, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "cpu_smoke", "--trainer.max_steps", "7", "--print_config"])
    printed = capsys.readouterr().out
    assert "max_steps: 7" in printed and "devices: 2" in printed


def test_another_lightning_module_can_be_named(in_tmp_dir, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model", "lightning.pytorch.demos.boring_classes.BoringModel", "--print_config"])
    assert "class_path: lightning.pytorch.demos.boring_classes.BoringModel" in capsys.readouterr().out


# ---------------------------------------------------------------- errors


def test_unknown_model_argument(in_tmp_dir, capsys):
    line = run_main_expecting_usage_error(capsys, "fit", "--model.n_layr", "3")
    assert "model" in line and "n_layr" in line and "not accepted" in line


def test_unknown_model_class(in_tmp_dir, capsys):
    line = run_main_expecting_usage_error(capsys, "fit", "--model", "NoSuchModel")
    assert "model" in line and "NoSuchModel" in line


def test_value_rejected_by_the_model(in_tmp_dir, capsys):
    line = run_main_expecting_usage_error(capsys, "fit", "--model.n_head", "3")
    assert "n_embd (128) must be divisible by n_head (3)" in line


def test_value_of_the_wrong_type(in_tmp_dir, capsys):
    line = run_main_expecting_usage_error(capsys, "fit", "--trainer.max_steps", "many")
    assert "trainer.max_steps" in line and "many" in line


def test_missing_recipe_lists_the_packaged_ones(in_tmp_dir, capsys):
    line = run_main_expecting_usage_error(capsys, "fit", "--config", "recipes/nope.yaml")
    assert "--config" in line and "recipes/nope.yaml" in line and "cpu_smoke" in line


def test_malformed_yaml_names_file_and_line(in_tmp_dir, capsys):
    (in_tmp_dir / "bad.yaml").write_text("trainer:\n  max_steps: [1\n")
    line = run_main_expecting_usage_error(capsys, "fit", "--config=bad.yaml")
    assert "bad.yaml" in line and "not valid YAML at line 3" in line


def test_yaml_that_is_not_a_mapping(in_tmp_dir, capsys):
    (in_tmp_dir / "list.yaml").write_text("- trainer\n- model\n")
    line = run_main_expecting_usage_error(capsys, "fit", "-c", "list.yaml")
    assert "list.yaml" in line and "mapping" in line


def test_unknown_key_in_a_recipe(in_tmp_dir, capsys):
    (in_tmp_dir / "typo.yaml").write_text("trainer:\n  max_stepz: 3\n")
    line = run_main_expecting_usage_error(capsys, "fit", "--config", "typo.yaml")
    assert "max_stepz" in line


def test_unknown_subcommand(in_tmp_dir, capsys):
    line = run_main_expecting_usage_error(capsys, "fti")
    assert "fti" in line and "fit" in line


# ---------------------------------------------------------------- real runs

SHORT_RUN = ["--trainer.max_steps", "12", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2",
             "--trainer.log_every_n_steps", "3"]  # fmt: skip


def read_metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_cpu_smoke_recipe_trains_on_two_processes_and_writes_metrics_and_checkpoint(in_tmp_dir):
    result = run_launcher(cli_command("fit", "--config", "recipes/cpu_smoke.yaml", *SHORT_RUN), timeout=240)
    output = result.stdout + result.stderr
    assert "distributed_backend=gloo" in output and "Starting with 2 processes" in output
    assert "Epoch 0:" in output  # the progress bar ran
    log_dir = in_tmp_dir / "lightning_logs" / "cpu_smoke" / "version_0"
    rows = read_metrics(log_dir)
    assert [int(r["step"]) for r in rows if r["train_loss"]] == [2, 5, 8, 11]
    assert any(r["val_loss"] and r["val_ppl"] for r in rows)
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert (log_dir / "config.yaml").is_file()


@pytest.mark.slow
def test_externally_launched_ranks_fit_then_validate_test_and_predict_from_the_checkpoint(in_tmp_dir):
    common = ["--config", "cpu_smoke", "--model.n_layer", "1", "--trainer.enable_progress_bar", "false"]
    run_cli(["fit", *common, *SHORT_RUN], world_size=2, timeout=240)
    checkpoint = in_tmp_dir / "lightning_logs" / "cpu_smoke" / "version_0" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    for subcommand in ("validate", "test", "predict"):
        outputs = run_cli(
            [subcommand, *common, "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2",
             "--trainer.limit_predict_batches", "2", "--ckpt_path", str(checkpoint)],
            world_size=2, timeout=240,
        )  # fmt: skip
        if subcommand == "test":
            assert "test_loss" in outputs[0].stdout and "test_ppl" in outputs[0].stdout
