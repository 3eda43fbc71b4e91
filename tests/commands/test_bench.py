"""lightning-fastdist bench: argument checks, and a real side-by-side run on 2 CPU processes."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fastdist.commands.bench.command import main, parse_args
from lightning_fastdist.commands.bench.probe import BenchProbe
from lightning_fastdist.commands.bench.rows import add_baseline_ratio, loss_spread
from lightning_fastdist.commands.bench.setup_run import _base_config, _overlay
from lightning_fastdist.commands.bench.setups import all_setups, recipe_setup
from lightning_fastdist.commands.bench.step_profile import StepProfile
from lightning_fastdist.demo import TinyGPT
from lightning_fastdist.parallel.ddp.buckets import gradient_bytes
from lightning_fastdist.recipes.recipe import MIXED_PRECISION_PLUGIN, Recipe
from tests.support.harness import cli_command, run_function, run_launcher
from tests.support.workloads import LossRecorder, distinct_batches, make_trainer, repeated_batches, tiny_gpt


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--setups", "ddp,zero4"],
            "--setups: unknown zero4; known: lightning-ddp, lightning-fsdp2, lightning-deepspeed,",
        ),
        (["--steps", "5"], "--steps: must be >= 6"),
        (["--warmup-steps", "10", "--steps", "12"], "--steps: must be >= 14"),
        (["--nodes", "0"], "--nodes: must be an integer >= 1, got '0'"),
        (["--config", "nope.yaml"], "--config: recipe file 'nope.yaml' not found"),
    ],
)
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_compares_engines_with_lightnings_own_and_writes_json_and_plot_and_nothing_else(in_tmp_dir):
    users = "# the user's own config, with comments\ntrainer: {max_steps: 3}\n"
    (in_tmp_dir / "config.yaml").write_text(users)
    model_args = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
                  "--data.block_size", "32", "--data.batch_size", "4"]  # fmt: skip
    setups = "lightning-deepspeed,ddp,fsdp-zero3,deepspeed-zero2"
    # --launcher runs each setup's fit (here through a shell that first leaves a mark, then torchrun, which starts
    # both ranks at once: half the start-up time of Lightning starting rank 1 after rank 0); --nodes 1 is one node.
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    shell = "sh -c 'touch bench_results/launched && exec \"$@\"' sh"
    launcher = ["--launcher", f"{shell} {torchrun} --standalone --nproc-per-node 2 --no-python", "--nodes", "1"]
    command = cli_command("bench", "--steps", "7", "--setups", setups, *launcher, "--", *model_args)
    result = run_launcher(command, timeout=400)
    assert (in_tmp_dir / "bench_results" / "launched").is_file()
    assert all(column in result.stdout for column in ("setup", "vs Lightning", "exposed ms", "held-out"))
    rows = {row["setup"]: row for row in json.loads((in_tmp_dir / "bench_results" / "bench.json").read_text())}
    assert set(rows) == set(setups.split(","))
    model = TinyGPT(n_layer=2, n_head=2, n_embd=32, block_size=32)
    full = gradient_bytes(model)
    root = full - gradient_bytes(model.blocks)  # embeddings and final norm, outside the blocks
    assert rows["ddp"]["comm_bytes_per_step"] == full
    # ZeRO-3 gathers the blocks for forward and again for backward, the root once; reduce-scatters every gradient.
    assert rows["fsdp-zero3"]["comm_bytes_by_collective"] == {"allgather": 2 * full - root, "reduce_scatter": full}
    # DeepSpeed's ZeRO-2 all-reduces the gradients (and two 4-byte scalars: norm and overflow), gathers the weights.
    assert rows["deepspeed-zero2"]["comm_bytes_by_collective"] == {"allreduce": full + 8, "allgather": full}
    for name in ("ddp", "fsdp-zero3", "deepspeed-zero2"):
        assert rows[name]["steps"] == 7
        assert rows[name]["tokens_per_s"] == pytest.approx(32 * rows[name]["samples_per_s"])  # 32-token sequences
        # The same seed and data: every engine computes the same fp32 training, to rounding.
        assert rows[name]["final_loss"] == pytest.approx(rows["ddp"]["final_loss"], abs=1e-4)
        assert rows[name]["tail_loss"] == pytest.approx(rows["ddp"]["tail_loss"], abs=1e-4)
        # Evaluated after the last step on the same 16 held-out batches (8 per rank): the same weights, the same loss.
        assert rows[name]["held_out_batches"] == 16
        assert rows[name]["held_out_loss"] == pytest.approx(rows["ddp"]["held_out_loss"], abs=1e-4)
        assert 0 <= rows[name]["exposed_comm_s"] < rows[name]["step_time_s"]  # Lightning's rows: test_exposed_comm
    for name in ("ddp", "fsdp-zero3"):
        assert rows[name]["host_syncs_per_step"] == 0  # SyncFreeLogging; steps 4 and 5 are not logging steps
    assert rows["deepspeed-zero2"]["host_syncs_per_step"] == 1  # DeepSpeed's own gradient-norm check
    assert rows["ddp"]["vs_lightning"] is None  # its baseline did not run
    assert "CUDA only" in rows["lightning-deepspeed"]["skipped"]
    parity = "loss parity: the final losses of ddp, fsdp-zero3, deepspeed-zero2 lie within"
    assert parity in result.stdout
    assert (in_tmp_dir / "bench_results" / "bench.png").stat().st_size > 10_000
    assert sorted(p.name for p in in_tmp_dir.iterdir()) == ["bench_results", "config.yaml"]
    assert (in_tmp_dir / "config.yaml").read_text() == users


def test_lightnings_fsdp2_baseline_puts_every_rank_in_the_data_parallel_dimension(in_tmp_dir):
    # Lightning's default (tensor_parallel_size = devices) would leave a model sharded over
    # device_mesh["data_parallel"] unsharded, with every rank reading the same batch.
    args = parse_args(["--setups", "lightning-fsdp2,deepspeed-zero2", "--devices", "4"])
    overlay = _overlay(all_setups()["lightning-fsdp2"], in_tmp_dir / "probe.json", in_tmp_dir, args)
    assert overlay["trainer"]["strategy"]["init_args"] == {"data_parallel_size": 4, "tensor_parallel_size": 1}
    assert overlay["model"] == {"class_path": "lightning_fastdist.commands.bench.baselines.HandShardedTinyGPT"}


def test_deepspeed_rows_take_the_recipes_mixed_precision_as_the_trainers_precision(in_tmp_dir):
    args = parse_args(["--config", "single_node", "--setups", "deepspeed-zero2"])  # bf16 through FastMixedPrecision
    overlay = _overlay(all_setups()["deepspeed-zero2"], in_tmp_dir / "probe.json", in_tmp_dir, args)
    assert overlay["trainer"]["plugins"] == [] and overlay["trainer"]["precision"] == "bf16-mixed"


def test_each_row_is_compared_with_its_engines_lightning_baseline_and_exact_losses_with_each_other():
    setups = all_setups()
    rows: list[dict] = []
    for name, tokens, loss in (("lightning-ddp", 100.0, 3.0), ("ddp", 150.0, 3.0), ("ddp-bf16", 160.0, 3.5),
                               ("deepspeed-zero2", 120.0, 3.00001)):  # fmt: skip
        row = {"setup": name, "engine": setups[name].engine, "exact": setups[name].exact, "step_time_s": 0.1,
               "tokens_per_s": tokens, "samples_per_s": tokens / 32, "final_loss": loss}  # fmt: skip
        add_baseline_ratio(row, rows, setups[name])
        rows.append(row)
    assert [row["vs_lightning"] for row in rows] == [1.0, 1.5, 1.6, None]  # no lightning-deepspeed row
    spread, names = loss_spread(rows)
    assert names == ["lightning-ddp", "ddp", "deepspeed-zero2"]  # bf16 gradient compression is not exact
    assert spread == pytest.approx(1e-5)


def test_the_recipe_row_trains_the_recipes_own_strategy_or_says_why_it_cannot():
    recipe = Recipe(
        {
            "trainer": {
                "strategy": {"class_path": "lightning_fastdist.FastFSDPStrategy", "init_args": {"sharding": "zero2"}}
            }
        }
    )
    setup = recipe_setup(recipe)
    assert (setup.engine, setup.baseline, setup.unavailable(recipe, 2)) == ("FSDP2", "lightning-fsdp2", None)
    assert setup.strategy_config(2) == recipe.trainer["strategy"]
    # The options the rows compare are each row's own: a tuned recipe's comm_hook reaches only the recipe row.
    tuned = {"class_path": "lightning_fastdist.FastDDPStrategy", "init_args": {"comm_hook": "bf16", "timeout": 60}}
    rows = {**all_setups(), "recipe": recipe_setup(Recipe({"trainer": {"strategy": tuned}}))}
    hooks = {name: rows[name].strategy_config(2)["init_args"]["comm_hook"] for name in ("ddp", "ddp-auto", "recipe")}
    assert hooks == {"ddp": "none", "ddp-auto": "auto", "recipe": "bf16"}
    assert rows["ddp-compile"].strategy_config(2)["init_args"]["activation_checkpointing"] == "none"
    named = recipe_setup(Recipe({"trainer": {"strategy": "ddp"}}))
    assert "the recipe's trainer.strategy is 'ddp'; this row needs a class_path" in named.unavailable(Recipe({}), 2)


def train_with_the_probe(output: str) -> tuple[list[float], float]:
    """One rank, 8 optimizer steps of 2 micro-batches under the probe (held-out: 3 batches); every micro-batch's
    loss, and the validation loss of the trained model on the first 3 held-out batches, by a Trainer of its own."""
    losses = LossRecorder()
    trainer = make_trainer("auto", devices=1, max_steps=8, accumulate_grad_batches=2)  # limit_val_batches=0
    trainer.callbacks.extend([BenchProbe(output, held_out_batches=3), losses])
    model = tiny_gpt()
    trainer.fit(model, repeated_batches(), val_dataloaders=distinct_batches())
    validator = make_trainer("auto", devices=1, limit_val_batches=3)
    [validated] = validator.validate(model, distinct_batches(), verbose=False)
    return losses.losses, validated["val_loss"]


@pytest.mark.multiprocess
def test_under_accumulation_the_probe_measures_optimizer_steps_and_the_tail_is_their_last_quarter(tmp_path):
    """tune's guard reads the held-out loss, else the tail loss; step time, tokens and syncs are per optimizer step,
    not per micro-batch. In a process of its own: a probe that left its sync counter entered would show in the next
    test there."""
    output = tmp_path / "row.json"
    ((losses, validated),) = run_function(train_with_the_probe, 1, args=(str(output),), init_process_group=False)
    row = json.loads(output.read_text())
    # One validation, after the last step, on the 3 batches asked for: what validating the trained model gives.
    assert row["held_out_batches"] == 3 and row["held_out_loss"] == pytest.approx(validated, rel=1e-6)
    # Lightning hands on_train_batch_end each micro-batch's loss divided by accumulate_grad_batches (2): the probe
    # reports the loss itself, as the model computed it.
    assert len(losses) == 16 and row["final_loss"] == pytest.approx(2 * losses[-1])
    assert row["tail_loss"] == pytest.approx(2 * sum(losses[-4:]) / 4)  # the last 2 steps' 4 micro-batches
    assert row["tail_loss"] != pytest.approx(row["final_loss"])  # the loss moves: a mean, not the last one
    # 2 micro-batches of 4 sequences of 16 tokens per optimizer step, on one rank.
    assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(2 * 4 * 16)
    assert row["host_syncs_per_step"] is not None


TINY_GPT = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
            "--data.block_size", "32", "--data.batch_size", "4"]  # fmt: skip


@pytest.mark.slow
def test_the_hand_written_loop_and_our_default_compute_what_lightnings_ddp_computes_in_fp32(in_tmp_dir):
    # One process each, fp32 (cpu_smoke), 2 micro-batches per step: the Trainer path and a plain loop over the same
    # model, data, seed and AdamW (fused in the loop) take the same steps, so every loss agrees.
    setups = "lightning-ddp,fast-default,hand-loop"
    command = cli_command("bench", "--devices", "1", "--steps", "7", "--setups", setups, "--compile-backend", "eager",
                          "--", *TINY_GPT, "--trainer.accumulate_grad_batches", "2")  # fmt: skip
    result = run_launcher(command, timeout=300)
    assert "MFU" in result.stdout.splitlines()[1]
    rows = {row["setup"]: row for row in json.loads((in_tmp_dir / "bench_results" / "bench.json").read_text())}
    assert set(rows) == set(setups.split(","))
    for name in ("fast-default", "hand-loop"):
        for loss in ("final_loss", "tail_loss", "held_out_loss"):
            assert rows[name][loss] == pytest.approx(rows["lightning-ddp"][loss], rel=1e-6), (name, loss)
        # The same work per optimizer step: 2 micro-batches of 4 sequences of 32 tokens.
        assert rows[name]["tokens_per_s"] * rows[name]["step_time_s"] == pytest.approx(2 * 4 * 32)
        assert rows[name]["host_syncs_per_step"] == 0
        assert rows[name]["mfu"] is None  # no GPU, no peak to measure against
    assert rows["hand-loop"]["optimizer_fused"] is True and rows["hand-loop"]["held_out_batches"] == 8
    assert rows["hand-loop"]["vs_lightning"] is not None


def test_lightnings_rows_train_in_lightnings_precision_and_ours_default_in_ours_with_no_option(in_tmp_dir):
    args = parse_args(["--config", "single_node", "--devices", "1"])  # FastMixedPrecision bf16-mixed, compile on
    setups = all_setups()
    lightning = _overlay(setups["lightning-ddp"], in_tmp_dir / "a.json", in_tmp_dir, args)["trainer"]
    assert (lightning["plugins"], lightning["precision"]) == ([], "bf16-mixed")
    ours = _overlay(setups["fast-default"], in_tmp_dir / "b.json", in_tmp_dir, args)["trainer"]
    assert ours["plugins"] == [{"class_path": MIXED_PRECISION_PLUGIN, "init_args": {"precision": "bf16-mixed"}}]
    assert ours["precision"] is None and ours["strategy"]["init_args"] == {}
    # An overlay cannot take the recipe's strategy options away (LightningCLI merges one class's init_args): a bare
    # row trains a copy of the recipe whose strategy has none; other rows train the recipe itself.
    base = yaml.safe_load(Path(_base_config(setups["fast-default"], args, in_tmp_dir)).read_text())
    assert base["trainer"]["strategy"] == {"class_path": "lightning_fastdist.FastDDPStrategy", "init_args": {}}
    assert base["model"] == args.recipe.config["model"]
    assert _base_config(setups["ddp"], args, in_tmp_dir) == "single_node"
    assert _base_config(setups["lightning-ddp"], args, in_tmp_dir) != "single_node"


def test_the_hand_written_loop_says_in_one_line_what_it_cannot_train():
    loop = all_setups()["hand-loop"]
    assert (
        loop.unavailable(Recipe({}), 2)
        == "the hand-written loop runs one process: give --devices 1 (this run has 2 ranks)"
    )
    other = Recipe({"model": {"class_path": "my_pkg.Model"}})
    assert loop.unavailable(other, 1).startswith("the hand-written loop calls lightning_fastdist.demo.TinyGPT's")
    assert loop.unavailable(Recipe({}), 1) is None


def test_profile_needs_its_steps_after_the_measured_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--profile", "--steps", "7"])
    assert "--steps: must be >= 8" in capsys.readouterr().err


def test_a_profile_writes_its_table_and_packed_trace_and_leaves_a_file_of_the_unpacked_name_alone(tmp_path):
    users = tmp_path / "ddp.trace.json"
    users.write_text("the user's own trace")
    recorder = StepProfile(tmp_path / "ddp", torch.device("cpu"))
    recorder.start()
    torch.ones(4, 4).matmul(torch.ones(4, 4))
    recorder.stop()
    assert "aten::" in (tmp_path / "ddp.ops.txt").read_text()
    with gzip.open(tmp_path / "ddp.trace.json.gz") as packed:
        assert "traceEvents" in json.load(packed)
    assert users.read_text() == "the user's own trace"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ddp.ops.txt", "ddp.trace.json", "ddp.trace.json.gz"]
