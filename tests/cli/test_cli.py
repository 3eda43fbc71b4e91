"""The lightning-fastdist command: defaults, recipes, one-line errors, and real 2-process runs."""

from __future__ import annotations

import csv
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fastdist.cli import QUIET_VARIABLE, main
from lightning_fastdist.cli.config import MARKER
from lightning_fastdist.recipes import available_recipes, find_recipe, recipes_dir
from tests.support.harness import cli_command, run_cli, run_cli_forked, run_launcher


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


# Rows of docs/bad-inputs.md that this command line produces: id -> what the one error line contains.
DOCUMENTED = {
    "recipe-empty": "is empty; a recipe holds a mapping of options (trainer:, model:, data:, ...).",
    "recipe-duplicate-key": "duplicate key 'max_steps' (first at line 2).",
    "ckpt-path-is-yaml": "is a YAML file, not a checkpoint. Give a checkpoint file or folder, or 'last' (the newest in "
    "the ModelCheckpoint folder); a recipe goes to --config.",
}


def test_the_refusals_are_documented():
    page = (Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md").read_text()
    assert [row for row, message in DOCUMENTED.items() if f"`{row}`" not in page or message not in page] == []


def test_an_empty_recipe_is_one_clear_error(in_tmp_dir, capsys):
    (in_tmp_dir / "empty.yaml").write_text("# nothing here yet\n")
    line = run_main_expecting_usage_error(capsys, "fit", "--config", "empty.yaml")
    assert f"--config: 'empty.yaml' {DOCUMENTED['recipe-empty']}" in line


def test_a_key_given_twice_in_a_recipe_is_an_error_naming_key_and_line(in_tmp_dir, capsys):
    (in_tmp_dir / "twice.yaml").write_text("trainer:\n  max_steps: 3\n  devices: 1\n  max_steps: 5\n")
    line = run_main_expecting_usage_error(capsys, "fit", "--config", "twice.yaml")
    assert f"'twice.yaml' is not valid YAML at line 4, column 3: {DOCUMENTED['recipe-duplicate-key']}" in line


def test_a_recipe_given_as_ckpt_path_is_refused(in_tmp_dir, capsys):
    recipe = recipes_dir() / "cpu_smoke.yaml"
    line = run_main_expecting_usage_error(capsys, "fit", "--ckpt_path", str(recipe))
    assert f"--ckpt_path: '{recipe}' {DOCUMENTED['ckpt-path-is-yaml']}" in line


# ---------------------------------------------------------------- help, modules, recipe init_args, config files


def test_help_lists_every_command_and_what_it_writes(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "recipes", "bench", "doctor"):
        assert f"\n  {command} " in text, command
    assert "bench_results/" in text and "doctor-recipe.yaml" in text and "checkpoints/RECIPE/" in text


MY_DATA = """
import lightning as L


class MyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 1, num_workers: int = 0) -> None:
        super().__init__()
"""


def test_modules_in_the_working_directory_are_found_and_recipe_init_args_stay_with_their_class(
    in_tmp_dir, capsys, monkeypatch
):
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if p not in ("", str(in_tmp_dir))]
    )  # as a console script sees it
    (in_tmp_dir / "mydata.py").write_text(MY_DATA)
    with pytest.raises(SystemExit):
        main(["fit", "--config", "cpu_smoke", "--data", "mydata.MyData", "--print_config"])
    captured = capsys.readouterr()
    data = yaml.safe_load(captured.out)["data"]
    assert data == {
        "class_path": "mydata.MyData",
        "init_args": {"batch_size": 1, "num_workers": 0},
    }  # not the recipe's 16
    (note,) = [line for line in captured.err.splitlines() if "note:" in line]
    assert "the recipe's data init_args (batch_size, block_size, num_workers) were written for " in note

    with pytest.raises(SystemExit):  # the same class keeps them
        main(["fit", "--config", "cpu_smoke", "--data", "TextDataModule", "--print_config"])
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["data"]["init_args"]["batch_size"] == 16 and "note:" not in captured.err


ONE_STEP = ["--trainer.devices", "1", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "2"]  # fmt: skip


def test_a_users_config_yaml_survives_a_run_without_logger_and_ours_is_replaced(in_tmp_dir, capsys):
    users = "# my own settings\ntrainer: {max_steps: 7}\n"
    (in_tmp_dir / "config.yaml").write_text(users)
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    lightning_info.addHandler(handler)
    try:
        main(["fit", "--config", "cpu_smoke", "--trainer.logger", "false", *ONE_STEP])
    finally:
        lightning_info.removeHandler(handler)
    assert any(line.startswith("GPU available") for line in shown)  # Lightning's own lines are kept
    assert not any("Tip" in line for line in shown)  # but not its advertisement
    assert (in_tmp_dir / "config.yaml").read_text() == users
    out = capsys.readouterr().out
    assert "config not saved (" in out and "config.yaml exists and was not written by lightning-fastdist)" in out

    (in_tmp_dir / "config.yaml").unlink()
    for max_steps in ("1", "2"):  # the second run replaces the config the first one wrote
        main(["fit", "--config", "cpu_smoke", "--trainer.logger", "false", *ONE_STEP, "--trainer.max_steps", max_steps])
        saved = (in_tmp_dir / "config.yaml").read_text()
        assert saved.startswith(MARKER) and yaml.safe_load(saved)["trainer"]["max_steps"] == int(max_steps)
        assert "; config in config.yaml;" in capsys.readouterr().out


# ---------------------------------------------------------------- real runs

SHORT_RUN = ["--trainer.max_steps", "12", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2",
             "--trainer.log_every_n_steps", "3"]  # fmt: skip


def read_metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


MY_MODEL = """
from lightning_fastdist.demo import TinyGPT


class MyModel(TinyGPT):
    pass
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpu_smoke_with_a_model_from_the_working_directory_on_two_launched_processes(in_tmp_dir):
    (in_tmp_dir / "mymodel.py").write_text(MY_MODEL)  # imported by rank 0 and by the rank Lightning launches
    model = ["--model", "mymodel.MyModel", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2"]
    result = run_launcher(
        cli_command("fit", "--config", "recipes/cpu_smoke.yaml", *model, *SHORT_RUN),
        env={QUIET_VARIABLE: "1"},
        timeout=240,
    )
    log_dir = Path("lightning_logs", "cpu_smoke", "version_0")
    rows = read_metrics(log_dir)
    assert [int(r["step"]) for r in rows if r["train_loss"]] == [2, 5, 8, 11]
    assert any(r["val_loss"] and r["val_ppl"] for r in rows)
    assert Path("checkpoints", "cpu_smoke", "last.ckpt").is_file()
    assert (log_dir / "config.yaml").read_text().startswith(MARKER)
    assert "Epoch 0:" in result.stdout  # the progress bar
    finished, where = result.stdout.splitlines()[-2:]
    assert finished.startswith("lightning-fastdist: finished at step 12: train_loss ")
    assert where == (
        f"lightning-fastdist: metrics in {log_dir / 'metrics.csv'}; config in {log_dir / 'config.yaml'}; "
        f"checkpoints in {Path('checkpoints', 'cpu_smoke')}/ (newest: last.ckpt)"
    )
    # Nothing else: no device banners, model summary, tips or warnings from either rank, only the note on --model.
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        "lightning-fastdist: note: --model mymodel.MyModel: the recipe's model init_args (block_size, learning_rate, "
        "n_embd, n_head, n_layer) were written for lightning_fastdist.demo.TinyGPT and are not applied; pass them "
        "as --model.NAME VALUE if mymodel.MyModel should get them."
    ]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_externally_launched_ranks_fit_then_validate_test_and_predict_from_the_checkpoint(in_tmp_dir):
    common = ["--config", "cpu_smoke", "--model.n_layer", "1", "--trainer.enable_progress_bar", "false"]
    run_cli(["fit", *common, *SHORT_RUN], world_size=2, timeout=240)
    checkpoint = in_tmp_dir / "checkpoints" / "cpu_smoke" / "last.ckpt"
    assert checkpoint.is_file()
    for subcommand in ("validate", "test", "predict"):  # the launch itself was checked by fit: forked, no start-up
        outputs = run_cli_forked(
            [subcommand, *common, "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2",
             "--trainer.limit_predict_batches", "2", "--ckpt_path", str(checkpoint)],
            world_size=2, timeout=240,
        )  # fmt: skip
        if subcommand == "test":
            assert "test_loss" in outputs[0].stdout and "test_ppl" in outputs[0].stdout
