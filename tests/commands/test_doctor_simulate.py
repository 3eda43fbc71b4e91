"""``doctor --simulate``: one traced step of the recipe's own model at world N, checked against real ranks."""

from __future__ import annotations

import json
import textwrap
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fastdist import OuterSync
from lightning_fastdist.commands.doctor.command import main as doctor
from lightning_fastdist.commands.doctor.simulate import (
    OUTER_SYNC_NOTES,
    choose,
    format_simulation,
    simulation_json,
    tailored_recipe,
)
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OUTER_SYNC_FORMS
from lightning_fastdist.planning.comm_model import comm_per_step
from lightning_fastdist.planning.outer_sync_memory import OuterSyncMemory
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.planning.simulation.recipe_run import RecipeRun, first_batch
from lightning_fastdist.planning.simulation.simulate import simulate
from lightning_fastdist.planning.simulation.trace import measure_setup
from lightning_fastdist.recipes.recipe import Recipe
from tests.support.harness import run_cli_forked, run_function

TINY_GPT = {"class_path": "lightning_fastdist.demo.TinyGPT", "init_args": {"n_layer": 2, "n_embd": 64, "n_head": 4}}
TEXT = {"class_path": "lightning_fastdist.demo.TextDataModule", "init_args": {"batch_size": 4, "num_workers": 0}}
LLAMA = {
    "class_path": "tests.support.model_zoo.HFLlama",
    "init_args": {},
}  # HuggingFace LlamaForCausalLM, tiny random config
TOKENS = {"class_path": "tests.support.model_zoo.RandomTokens", "init_args": {}}
MEASURED = [(setup, checkpointing) for setup in ("ddp", "zero2", "zero3") for checkpointing in ("none", "full")]


def write_recipe(path: Path, model: dict, data: dict, **trainer) -> Path:
    trainer = {"accelerator": "cpu", "devices": 2, "max_steps": 2, "logger": False, **trainer}
    path.write_text(yaml.safe_dump({"trainer": trainer, "model": model, "data": data}, sort_keys=False))
    return path


def simulated_rows(tmp_path: Path, recipe: Path, *flags: str) -> dict:
    out = tmp_path / "simulation.json"
    argv = ["--config", str(recipe), "--simulate", "--gpu-memory", "1", "--json", str(out), *flags]
    assert doctor([*argv, "--output", str(tmp_path / "plan.yaml")]) == 0
    document = json.loads(out.read_text())
    return {(row["setup"], row["activation_checkpointing"], row["cpu_offload"]): row for row in document["setups"]}


def real_memory(run: RecipeRun) -> dict:
    """Each setup trained for real on this rank (real tensors, gloo, a real DDP), measured with the same tracker."""
    warnings.simplefilter("ignore")
    batch = first_batch(run.data)
    measured = {}
    for setup, checkpointing in MEASURED:
        torch.manual_seed(0)
        traced = measure_setup(run, batch, Setup.from_plan_key(setup, checkpointing, False), 2, fake=False)
        measured[(setup, checkpointing)] = traced.memory
    return measured


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("model", "data"), [(TINY_GPT, TEXT), (LLAMA, TOKENS)], ids=["tinygpt", "hf-llama"])
def test_simulated_state_and_peak_agree_with_two_real_ranks(tmp_path, model, data):
    recipe = write_recipe(tmp_path / "recipe.yaml", model, data)
    simulated = simulated_rows(tmp_path, recipe, "--world-size", "2")
    real = run_function(real_memory, 2, args=(RecipeRun(model, data),), timeout=240)
    for rank_memory in real:  # both ranks hold the same share
        for (setup, checkpointing), memory in rank_memory.items():
            per_rank = simulated[(setup, checkpointing, False)]["per_rank"]
            state = per_rank["params"] + per_rank["grads"] + per_rank["optimizer"]
            assert state == pytest.approx(memory.state, rel=0.02), (setup, checkpointing)
            assert per_rank["peak"] == pytest.approx(memory.peak, rel=0.10), (setup, checkpointing)
    zero3 = simulated[("zero3", "none", False)]["per_rank"]
    assert zero3["params"] < simulated[("ddp", "none", False)]["per_rank"]["params"]
    assert simulated[("zero3", "full", False)]["per_rank"]["activations_peak"] < zero3["activations_peak"]


def test_sharded_state_at_world_64_is_a_32nd_of_world_2_and_hsdp_shards_within_a_node():
    run = RecipeRun(TINY_GPT, TEXT)
    small, large = (simulate(run, world, 8, checkpointing=("none",)) for world in (2, 64))
    by_setup = [{row.name: row.memory for row in sim.rows if not row.cpu_offload} for sim in (small, large)]
    for field in ("params", "grads", "optimizer"):
        at_2, at_64 = getattr(by_setup[0]["zero3"], field), getattr(by_setup[1]["zero3"], field)
        assert at_2 / 32 <= at_64 <= at_2 / 32 * 1.05, field  # FSDP pads each tensor's rows to the world size
        assert getattr(by_setup[1]["ddp"], field) == getattr(by_setup[0]["ddp"], field)  # a full replica anywhere
    assert "hsdp" not in by_setup[0] and by_setup[1]["hsdp"].params == pytest.approx(
        by_setup[0]["zero3"].params / 4, rel=0.05
    )
    for outer in ("ddp-diloco", "fsdp-zero3-diloco"):  # outer_sync spans nodes
        assert outer not in by_setup[0] and outer in by_setup[1]
    ds3 = by_setup[1]["ds-zero3"]
    assert ds3.optimizer == -(-12 * large.parameters // 64)  # DeepSpeed's fp32 master copy and two moments, sharded
    assert simulate(run, 64, 8, checkpointing=("none",), processes=2).rows == large.rows  # two workers, same numbers


def test_outer_sync_rows_add_torchft_state_to_local_rank_0_and_are_never_recommended():
    """At 2 nodes x 2 ranks: bench's DiLoCo, here the recipe's own (momentum, one all-reduce overlapping a step), on
    top of the ddp row; bench's Streaming DiLoCo, whose 4 fragments TinyGPT's 2 blocks cannot take, not traced."""
    own = {"every": 4, "fragments": 1, "delay": 1, "momentum": 0.9}
    run = RecipeRun(TINY_GPT, TEXT, outer_sync=own)
    simulation = simulate(run, 4, 2, checkpointing=("none",))
    rows = {row.name: row for row in simulation.rows}
    ddp, diloco, n = rows["ddp"].memory, rows["ddp-diloco"], simulation.parameters
    assert diloco.outer_sync == OuterSync(**own) and OuterSync(**OUTER_SYNC_FORMS["diloco"]) != diloco.outer_sync
    # fp32 weights: a host copy and a device momentum of 4 N each; one fragment of N in flight as fp32 and bf16.
    assert (diloco.outer_memory.global_copy, diloco.outer_memory.outer_momentum) == (4 * n, 4 * n)
    assert (diloco.outer_memory.in_flight, diloco.outer_memory.applying) == (6 * n, 8 * n)
    assert diloco.memory.optimizer == ddp.optimizer + 4 * n and diloco.memory.peak == ddp.peak + 4 * n + 6 * n
    assert (diloco.memory.params, diloco.memory.grads) == (ddp.params, ddp.grads)
    # DDP's gradients inside the node, and every pseudo-gradient in bf16 once per 4 steps across the 2 nodes.
    inner = comm_per_step("ddp", 2, n, 0, "32-true").sent_per_device
    assert diloco.comm_bytes_per_step == inner + 2 * n // 4
    reason = (
        "outer_sync.fragments=4 does not divide the model's 2 blocks: give a divisor of 2 (or name the blocks with "
        "`blocks`)."
    )
    assert [(setup, why) for setup, _, why in simulation.not_traced] == [
        ("ddp-streaming-diloco", reason),
        ("fsdp-zero3-streaming-diloco", reason),
    ]
    lines = format_simulation(simulation, "32-true", 2**30, 2**30).splitlines()
    (row,) = [line for line in lines if line.startswith("  ddp-diloco ")]
    assert row.endswith(f"derived, {4 * n / 2**30:.3f}G on the host")
    assert any(line.split()[:4] == ["ddp-streaming-diloco", "none", "not", "traced,"] for line in lines)
    for usable in (2**30, 1):  # everything fits, nothing fits
        chosen, _ = choose(simulation, usable)
        document = simulation_json(simulation, usable, 2**30, chosen)
        assert chosen.outer_sync is None and document["recommendation"]["setup"] != "ddp-diloco"
    outer, _ = [row for row in document["setups"] if "outer_sync" in row]
    assert outer["setup"] == "ddp-diloco" and outer["outer_sync"]["options"]["momentum"] == 0.9
    assert outer["outer_sync"]["global_copy"] == 4 * n and outer["per_rank"]["peak"] == diloco.memory.peak


def test_fsdp_outer_sync_rows_shard_over_one_node_and_every_rank_holds_torchft_state_of_its_shard():
    """At 2 nodes x 2 ranks FSDP shards over the node's 2 ranks (the zero3 row of a world of 2, not of 4), and each
    rank holds torchft's state for its half of each fragment (TinyGPT's dims 0 are even): the global copy, the outer
    momentum, the pseudo-gradient in flight (fp32 and its bf16 copy) and, applied, with a copy of the weights."""
    run = RecipeRun(TINY_GPT, TEXT, outer_sync={"every": 4, "fragments": 1, "delay": 1, "momentum": 0.9})
    simulation = simulate(run, 4, 2, checkpointing=("none",))
    rows = {row.name: row for row in simulation.rows}
    one_node = {row.name: row for row in simulate(run, 2, 2, checkpointing=("none",)).rows}["zero3"]
    diloco, half = rows["fsdp-zero3-diloco"], simulation.parameters // 2
    assert diloco.outer_memory == OuterSyncMemory(4 * half, 4 * half, 6 * half, 8 * half, overlaps_steps=True)
    on_top = replace(one_node.memory, optimizer=one_node.memory.optimizer + 4 * half)
    assert diloco.memory == replace(on_top, peak=one_node.memory.peak + 4 * half + 6 * half)
    assert diloco.memory.params > rows["zero3"].memory.params  # a node's share, not the world's
    # ZeRO-3's traffic inside the node, and each rank's half of the pseudo-gradients in bf16 once per 4 steps.
    assert diloco.comm_bytes_per_step == one_node.comm_bytes_per_step + 2 * half // 4
    lines = format_simulation(simulation, "32-true", 2**30, 2**30).splitlines()
    (row,) = [line for line in lines if line.startswith("  fsdp-zero3-diloco ")]
    assert row.endswith(f"derived, {4 * half / 2**30:.3f}G on the host") and lines[-1] == OUTER_SYNC_NOTES["zero3"]


def test_replica_groups_rows_shard_over_one_node_and_hold_the_kept_copy_of_their_gradients():
    """At 2 nodes x 2 ranks under the recipe's replica_groups: DDP, ZeRO-2 and ZeRO-3 only (the setups whose strategies
    take the option), FSDP sharded over one node's 2 ranks. Each rank's kept copy of its gradients is in its gradients
    and its peak, and it sends its setup's traffic inside the node plus its gradients on a ring of the 2 nodes."""
    run = RecipeRun(TINY_GPT, TEXT, replica_groups={"min_nodes": 1})
    simulation = simulate(run, 4, 2, checkpointing=("none",))
    one_node = {row.name: row for row in simulate(RecipeRun(TINY_GPT, TEXT), 2, 2, checkpointing=("none",)).rows}
    rows = {row.name: row for row in simulation.rows}
    assert sorted(rows) == ["ddp", "zero2", "zero3"] and simulation.not_traced == []
    for name, row in rows.items():
        alone = one_node[name].memory
        assert row.memory == replace(alone, grads=2 * alone.grads, peak=alone.peak + alone.grads), name
        assert row.comm_bytes_per_step == one_node[name].comm_bytes_per_step + alone.grads, name  # 2 * (2 - 1) / 2
    assert rows["ddp"].memory.grads == 2 * 4 * simulation.parameters
    assert rows["zero3"].memory.params == one_node["zero3"].memory.params  # a node's share, not the world's
    lines = format_simulation(simulation, "32-true", 2**30, 2**30).splitlines()
    assert lines[-1].startswith("  replica_groups (the recipe's): each of the 2 nodes a torchft replica group; FSDP")
    chosen, _ = choose(simulation, 2**30)
    assert simulation_json(simulation, 2**30, 2**30, chosen)["replica_groups"] == {"min_nodes": 1}
    trainer = tailored_recipe(Recipe.read("multi_node_fault_tolerant"), chosen, 2, 2)["trainer"]
    assert trainer["strategy"]["init_args"]["replica_groups"] == {"min_nodes": 1}  # the recipe's, kept
    assert trainer["strategy"]["class_path"] == "lightning_fastdist.FastDDPStrategy" and trainer["num_nodes"] == 2


def test_hsdp_reduces_within_a_node_and_all_reduces_its_shard_across_nodes():
    comm = comm_per_step("hsdp", 16, 1000, 100, "32-true", shard_group=8)
    assert (comm.allgather, comm.reduce_scatter, comm.allreduce) == ((2 * 1000 - 100) * 4, 4000, 500)
    assert comm.sent_per_device == (7 * (7600 + 4000)) // 8 + 500  # rings of 8, and of 2 for the all-reduce


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_model_in_the_working_directory_is_simulated_and_the_recipe_it_gets_trains(tmp_path):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import lightning as L, torch
            from torch import nn
            from torch.utils.data import DataLoader, TensorDataset

            class Layer(nn.Module):
                def __init__(self, width):
                    super().__init__()
                    self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)
                def forward(self, x):
                    return x + self.linear(self.norm(x))

            class Net(L.LightningModule):
                def __init__(self, width: int = 32, depth: int = 3):
                    super().__init__()
                    self.layers = nn.Sequential(*[Layer(width) for _ in range(depth)])
                def training_step(self, batch, batch_idx):
                    x, y = batch
                    return nn.functional.mse_loss(self.layers(x), y)
                def configure_optimizers(self):
                    return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

            class Data(L.LightningDataModule):
                def train_dataloader(self):
                    return DataLoader(TensorDataset(torch.randn(16, 32), torch.randn(16, 32)), batch_size=4)
            """
        )
    )
    write_recipe(
        tmp_path / "recipe.yaml", {"class_path": "my_models.Net"}, {"class_path": "my_models.Data"},
        strategy={"class_path": "lightning_fastdist.FastDDPStrategy", "init_args": {"timeout": 60}},
    )  # fmt: skip
    argv = ["doctor", "--config", "recipe.yaml", "--simulate", "--world-size", "2", "--gpu-memory", "1"]
    run_cli_forked(argv, world_size=1, cwd=tmp_path, timeout=120)  # a simulation makes its own process group
    plan = yaml.safe_load((tmp_path / "doctor-recipe.yaml").read_text())
    assert plan["trainer"]["strategy"] == {
        "class_path": "lightning_fastdist.FastDDPStrategy",
        "init_args": {"bucket_cap_mb": "auto", "activation_checkpointing": "none", "timeout": 60},
    }
    assert (plan["trainer"]["devices"], plan["trainer"]["num_nodes"]) == (2, 1)
    # Its 2 ranks with torchrun's environment, forked without a start-up of their own (a model from the working
    # directory in freshly started ranks, under both launches: test_cli.py).
    run_cli_forked(["fit", "--config", "doctor-recipe.yaml"], world_size=2, cwd=tmp_path, timeout=180)


def test_a_step_that_reads_a_value_falls_back_to_the_formula_with_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "reads_values.py").write_text(
        textwrap.dedent(
            """
            from lightning_fastdist.demo import TinyGPT

            class ValueReadingGPT(TinyGPT):
                def training_step(self, batch, batch_idx):
                    loss = super().training_step(batch, batch_idx)
                    assert loss.item() < 1e9  # a host read: its value does not exist in a simulation
                    return loss
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = {"class_path": "reads_values.ValueReadingGPT", "init_args": TINY_GPT["init_args"]}
    recipe = write_recipe(tmp_path / "recipe.yaml", model, TEXT)
    assert doctor(["--config", str(recipe), "--simulate", "--world-size", "2", "--gpu-memory", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("cannot trace the recipe") == 1 and "the formula estimate follows" in printed
    assert "Memory per device (" in printed  # the formula's table, for the same 2 GPUs
    assert "For 1 node(s) x 2 gpu(s)" in (tmp_path / "doctor-recipe.yaml").read_text()


def test_a_json_file_the_user_wrote_is_kept_and_bad_flags_get_one_line(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe.yaml", TINY_GPT, TEXT)
    theirs = tmp_path / "notes.json"
    theirs.write_text('{"mine": true}\n')
    cases = [
        (
            ["--json", str(theirs), "--world-size", "2"],
            "--json: " + str(theirs) + " exists and was not written by doctor",
        ),
        (["--world-size", "6", "--gpus", "4"], "--world-size: 6 is not a multiple of --gpus 4"),
    ]
    for flags, message in cases:
        assert doctor(["--config", str(recipe), "--simulate", *flags]) == 2
        assert message in capsys.readouterr().err
    assert theirs.read_text() == '{"mine": true}\n'
    assert doctor(["--simulate", "--world-size", "2"]) == 2
    assert "--simulate: needs --config RECIPE" in capsys.readouterr().err
    assert doctor(["--world-size", "2"]) == 2
    assert "--world-size and --json: only with --simulate" in capsys.readouterr().err
