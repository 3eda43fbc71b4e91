"""lightning-fastdist tune: refusals before any trial, then a real tune of a HuggingFace decoder on 2 CPU ranks."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lightning_fastdist.commands.bench.setups import all_setups
from lightning_fastdist.commands.tune.candidates import DEFAULT_SETUPS, Candidate, MemoryPlan, memory_verdict, offered
from lightning_fastdist.commands.tune.command import base_candidates, main, progress_line
from lightning_fastdist.commands.tune.search import Search
from lightning_fastdist.planning.advisor import HEADROOM
from lightning_fastdist.planning.memory_model import GiB
from lightning_fastdist.recipes.recipe import Recipe
from tests.support.emulated_cluster import REPO_ROOT
from tests.support.harness import cli_command, run_cli_forked, run_launcher

LLAMA = {
    "class_path": "tests.support.model_zoo.HFLlama",
    "init_args": {},
}  # HuggingFace LlamaForCausalLM, tiny random config
TOKENS = {"class_path": "tests.support.model_zoo.RandomTokens", "init_args": {"batch_size": 2, "samples": 16}}


def write_recipe(path, accumulation: int = 1) -> dict:
    recipe = {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            # The user's own options reach every candidate that takes them: rank 4 makes the tiny model's
            # 32-wide matrices compressible (at the default rank 16 PowerSGD would send them exactly).
            "strategy": {
                "class_path": "lightning_fastdist.FastDDPStrategy",
                "init_args": {"timeout": 60, "powersgd_rank": 4},
            },
            "accumulate_grad_batches": accumulation,
            "max_steps": 4,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
        },
        "model": LLAMA,
        "data": TOKENS,
    }
    path.write_text(yaml.safe_dump(recipe))
    return recipe


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--setups", "ddp,lightning-ddp"], "--setups: unknown lightning-ddp; known: ddp, ddp-auto, ddp-fp16,"),
        (["--steps", "5"], "--steps: must be >= 6"),
        (["--budget-minutes", "0"], "--budget-minutes: must be a finite number > 0, got '0'"),
        (["--loss-tolerance", "nan"], "--loss-tolerance: must be a finite number > 0, got 'nan'"),
        (["--config", "nope.yaml"], "--config: recipe file 'nope.yaml' not found"),
        (["--output", "users.yaml"], "--output: users.yaml exists and was not written by tune, so it is kept"),
        (["--json", "users.yaml"], "--json: users.yaml exists and was not written by tune, so it is kept"),
        (["--workdir", "users"], "--workdir: users holds files tune did not write; give a new or empty folder"),
        (["--config", "multi_node_fault_tolerant", "--nodes", "1"], "the recipe's replica_groups synchronises"),
    ],
)
def test_bad_arguments_name_the_flag_and_nothing_of_the_users_is_touched(argv, message, capsys, in_tmp_dir):
    (in_tmp_dir / "users.yaml").write_text("mine: 1\n")
    (in_tmp_dir / "users").mkdir()
    (in_tmp_dir / "users" / "notes.txt").write_text("mine\n")
    with pytest.raises(SystemExit) as stop:
        main(["--config", "cpu_smoke", *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert (in_tmp_dir / "users.yaml").read_text() == "mine: 1\n"
    assert sorted(p.name for p in in_tmp_dir.iterdir()) == ["users", "users.yaml"]  # no work folder was made


def _usable_between(fits: str, does_not: str) -> float:
    """A --gpu-memory (GiB) whose usable part holds the ``fits`` setup's simulated peak but not ``does_not``'s,
    from ``doctor --simulate`` on ``recipe.yaml``."""
    argv = ["doctor", "--config", "recipe.yaml", "--simulate", "--world-size", "2", "--json", "plan.json"]
    run_cli_forked([*argv, "--output", "doctor.yaml"], world_size=1)  # a simulation makes its own process group
    rows = json.loads(Path("plan.json").read_text())["setups"]
    peaks = {(r["setup"], r["activation_checkpointing"]): r["per_rank"]["peak"] for r in rows if not r["cpu_offload"]}
    low, high = peaks[(fits, "none")], min(peaks[(does_not, mode)] for mode in ("none", "selective", "full"))
    assert low < high, peaks
    return (low + high) / 2 / (1 - HEADROOM) / GiB


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tune_prunes_by_the_plan_guards_the_loss_and_writes_a_recipe_that_trains(in_tmp_dir):
    """A real tune (the halving's decisions are held by the test below, whose trials are a table)."""
    recipe = write_recipe(in_tmp_dir / "recipe.yaml", accumulation=2)
    memory = _usable_between(fits="ddp", does_not="ds-zero1")
    argv = [
        "tune", "--config", "recipe.yaml", "--setups", "ddp,ddp-powersgd,deepspeed-zero1",
        "--gpu-memory", f"{memory:.9f}", "--compile-backend", "none", "--loss-tolerance", "1e-6",
        "--json", "tune.json", "--budget-minutes", "20", "--steps", "6",
    ]  # fmt: skip
    env = {"PYTHONPATH": str(REPO_ROOT)}
    result = run_launcher(cli_command(*argv), timeout=500, env=env)
    assert "tune took" in result.stdout
    document = json.loads((in_tmp_dir / "tune.json").read_text())
    trials = {c["name"]: c for c in document["candidates"]}
    usable = document["memory_plan"]["usable_bytes"]
    # The plan's verdict decided which ran: what does not fit never started (no log of it anywhere).
    logs = {path.stem for path in (in_tmp_dir / "tune_runs").rglob("*.log")}
    for name, trial in trials.items():
        if trial["status"] == "pruned":
            assert trial["peak_plan_bytes"] > usable and name not in logs, name
        elif trial["rounds"]:
            assert trial["peak_plan_bytes"] <= usable and name in logs, name
    assert trials["deepspeed-zero1"]["status"] == "pruned"
    assert "memory plan: peak" in trials["deepspeed-zero1"]["reason"]
    # PowerSGD's loss is not within 1e-6 of exact DDP's on the same batches: measured, then refused.
    assert trials["ddp-powersgd"]["status"] == "rejected" and "tolerance" in trials["ddp-powersgd"]["reason"]
    assert trials["ddp-powersgd"]["compared_with"] == "ddp"
    assert trials["ddp-powersgd"]["reason"].startswith("training tail loss")  # this recipe has no held-out data
    # Accumulating 2, the fastest is also planned with micro-batches twice as large and no accumulation: here
    # twice the activations do not fit, so it is pruned before it starts, like the setups planned at the start.
    larger = [trial for name, trial in trials.items() if name.endswith("+mb4x1")]
    assert len(larger) == 1 and larger[0]["status"] == "pruned", trials.keys()
    # One accepted: no second round; the winner is the exact DDP.
    winner = document["winner"]
    assert winner == "ddp" and trials[winner]["status"] == "winner" and len(trials[winner]["rounds"]) == 1
    assert (in_tmp_dir / "tune_runs" / "tune.png").is_file()

    tuned = yaml.safe_load((in_tmp_dir / "tuned.yaml").read_text())
    assert tuned["model"] == recipe["model"] and tuned["data"]["class_path"] == recipe["data"]["class_path"]
    assert tuned["trainer"]["strategy"] == {
        "class_path": trials[winner]["strategy"]["class_path"],
        "init_args": {**trials[winner]["strategy"]["init_args"], "timeout": 60, "powersgd_rank": 4},  # kept
    }
    assert (in_tmp_dir / "tuned.yaml").read_text().startswith("# Written by: lightning-fastdist tune")
    # Its 2 ranks forked without a start-up of their own (check=True: both exit 0); the trials above started fresh.
    run_cli_forked(["fit", "--config", "tuned.yaml", "--trainer.max_steps", "2"], timeout=180)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_device_too_small_for_everything_starts_no_trial_and_writes_no_recipe(in_tmp_dir):
    write_recipe(in_tmp_dir / "recipe.yaml")
    argv = ["tune", "--config", "recipe.yaml", "--setups", "ddp,ddp-bf16,fsdp-zero3", "--gpu-memory", "0.0001"]
    [output] = run_cli_forked([*argv, "--json", "tune.json"], world_size=1, check=False)
    stdout, stderr = output.stdout, output.stderr
    assert output.returncode == 1, stdout + stderr
    # Planned at the recipe's micro-batch 2, then at 1 with twice the accumulation: nothing fits either.
    assert "nothing fits: the same global batch as micro-batch 1 x 2 accumulated" in stdout
    assert "no candidate trained and passed; no recipe written" in stderr
    trials = json.loads((in_tmp_dir / "tune.json").read_text())["candidates"]
    assert trials and all(t["status"] == "pruned" and not t["rounds"] for t in trials)
    assert {t["micro_batch"] for t in trials} == {None, 1}
    assert not list((in_tmp_dir / "tune_runs").rglob("*.log")) and not (in_tmp_dir / "tuned.yaml").exists()


def test_the_winner_is_checked_against_its_exact_root_after_its_last_round_and_the_next_best_takes_its_place():
    """The search's decisions, with training replaced by a table: PowerSGD's loss drifts from exact DDP's as the
    steps grow (0.6% after 6, 1.8% after 18), bf16's stays within 0.01%."""
    setups = all_setups()
    speeds = {"ddp": 100, "fsdp-zero2": 50, "fsdp-zero3": 150, "ddp-bf16": 200, "ddp-powersgd": 300}
    drift = {"ddp": 0.0, "fsdp-zero2": 0.0, "fsdp-zero3": 0.0, "ddp-bf16": 1e-6, "ddp-powersgd": 1e-3}
    trained = []

    def measure(candidate, steps, round_number):
        trained.append((candidate.name, steps))
        loss = 2.0 * (1 + drift[candidate.name] * steps)
        return {"step_time_s": 1.0, "tokens_per_s": speeds[candidate.name], "samples_per_s": 1.0, "tail_loss": loss}

    plan = MemoryPlan({}, world_size=2, gpus_per_node=2, usable_bytes=None)
    search = Search(measure, plan, 6, 3600.0, 0.01, None, report=lambda trial, round_number: None)
    exact = [Candidate(setups[name]) for name in ("ddp", "fsdp-zero2", "fsdp-zero3")]
    compressed = [Candidate(setups[name], compared_with="ddp") for name in ("ddp-bf16", "ddp-powersgd")]
    search.try_in_order(exact + compressed)
    winner = search.halve()
    # Round 1 all five (PowerSGD 0.6% from DDP: accepted); round 2 the fastest third, at least two, at 3x the
    # steps; then DDP, left behind in round 1, trains 18 steps as the root of PowerSGD's comparison: 1.8%.
    assert trained == [*[(name, 6) for name in speeds], ("ddp-powersgd", 18), ("ddp-bf16", 18), ("ddp", 18)]
    powersgd = search.trials["ddp-powersgd"]
    assert powersgd.status == "rejected" and "after 18 steps" in powersgd.reason
    assert powersgd.reason.startswith("training tail loss")  # these rows have no held-out loss
    assert winner is search.trials["ddp-bf16"] and winner.status == "winner"


def test_a_candidate_is_planned_as_its_bench_row_trains_it():
    setups = all_setups()
    assert Candidate(setups["fsdp-zero3-ac"]).plan_key == ("zero3", "full", False)
    assert Candidate(setups["fsdp-zero3-ac"], "selective").plan_key == ("zero3", "selective", False)
    assert Candidate(setups["deepspeed-zero2-offload"]).plan_key == ("ds-zero2", "none", True)
    assert Candidate(setups["ddp-bf16"], "full").plan_key == ("ddp", "full", False)


def test_the_guard_compares_held_out_losses_where_both_rows_have_them_and_says_which_it_compared():
    """Rows as bench writes them, made up: DiLoCo's training loss (its node's own weights) stays within 0.1% of exact
    DDP's, the held-out loss of its global weights too after 6 steps but 4% above after 18; streaming DiLoCo's
    training loss is 25% above, its held-out loss 0.5%."""
    setups = all_setups()
    speeds = {"ddp": 100, "ddp-diloco": 300, "ddp-streaming-diloco": 50, "ddp-powersgd": 400, "ddp-bf16": 60}
    held_out = {"ddp": 2.0, "ddp-streaming-diloco": 2.01, "ddp-powersgd": math.nan, "ddp-bf16": None}
    tail = {"ddp": 2.0, "ddp-diloco": 2.002, "ddp-streaming-diloco": 2.5, "ddp-powersgd": 2.0, "ddp-bf16": 2.001}

    def measure(candidate, steps, round_number):
        name = candidate.name
        loss = held_out[name] if name in held_out else 2.0 + 0.08 * (steps > 6)  # ddp-diloco
        return {"step_time_s": 1.0, "tokens_per_s": speeds[name], "samples_per_s": 1.0, "tail_loss": tail[name],
                "held_out_loss": loss, "exposed_comm_s": None, "peak_memory_bytes_max_rank": 2**20}  # fmt: skip

    reports = []
    plan = MemoryPlan({}, world_size=2, gpus_per_node=1, usable_bytes=None)
    search = Search(measure, plan, 6, 3600.0, 0.01, None, lambda trial, round_number: reports.append(trial.status))
    compared = [Candidate(setups[name], compared_with="ddp") for name in speeds if name != "ddp"]
    search.try_in_order([Candidate(setups["ddp"]), *compared])
    trials = search.trials
    assert trials["ddp-diloco"].guard.startswith("held-out loss 2.0000 vs ddp's 2.0000, both after 6 steps")
    streaming = trials["ddp-streaming-diloco"]
    assert streaming.status == "measured" and streaming.reason is None
    assert streaming.guard.startswith("held-out loss 2.0100 vs ddp's 2.0000")
    assert "0.5% apart, within the tolerance of 1%" in streaming.guard
    assert trials["ddp-powersgd"].status == "rejected"
    assert trials["ddp-powersgd"].reason == "no finite held-out loss to compare with ddp's"
    bf16 = trials["ddp-bf16"]
    assert bf16.status == "measured" and bf16.guard.startswith("training tail loss 2.0010 vs ddp's 2.0000")
    # What tune prints for an accepted candidate: its numbers, then the guard's line under them.
    numbers, guard = progress_line(streaming, 1, 0.0).splitlines()
    assert numbers.endswith("tail loss 2.5000  held-out loss 2.0100") and guard.strip() == f"guard: {streaming.guard}"

    # Round 2: DiLoCo (the fastest) trains 18 steps before DDP does; once DDP has, DiLoCo is refused, and said so.
    reports.clear()
    assert search.halve() is trials["ddp"]
    assert trials["ddp-diloco"].reason == (
        "held-out loss 2.0800 vs ddp's 2.0000, both after 18 steps of the same global batch (equal tokens): "
        "4% apart, beyond the tolerance of 1%"
    )
    assert reports == ["measured", "measured", "rejected"]  # diloco's numbers, ddp's, then diloco's refusal


def test_the_diloco_rows_are_candidates_across_nodes_only_and_compared_with_exact_ddp():
    args = argparse.Namespace(setup_list=list(DEFAULT_SETUPS), recipe=Recipe.read("cpu_smoke"))

    def candidates(nodes: int) -> dict[str, Candidate]:
        plan = MemoryPlan({}, world_size=2, gpus_per_node=2 // nodes, usable_bytes=None)
        return {candidate.name: candidate for candidate in base_candidates(args, plan, None)}

    across, one_node = candidates(2), candidates(1)
    for name in ("ddp-diloco", "ddp-streaming-diloco", "fsdp-hsdp"):
        assert name in across and name not in one_node
    assert across["ddp-diloco"].compared_with == across["ddp-streaming-diloco"].compared_with == "ddp"
    assert set(one_node) == set(across) - {"ddp-diloco", "ddp-streaming-diloco", "fsdp-hsdp"}
    # Where torchft is missing, bench's row says so (its `needs`) and tune does not offer it.
    diloco = all_setups()["ddp-diloco"]
    assert offered(diloco, across_nodes=True)
    assert not offered(replace(diloco, needs="torchft is not installed"), across_nodes=True)


def test_a_recipe_with_replica_groups_is_tuned_among_the_setups_that_take_them():
    # As doctor plans it: a DeepSpeed, hsdp, PowerSGD or DiLoCo winner would lose the option (or be refused by it).
    args = argparse.Namespace(setup_list=list(DEFAULT_SETUPS), recipe=Recipe.read("multi_node_fault_tolerant"))
    plan = MemoryPlan({}, world_size=4, gpus_per_node=2, usable_bytes=None)
    names = {candidate.name for candidate in base_candidates(args, plan, None)}
    assert names == {"ddp", "ddp-bf16", "fsdp-zero2", "fsdp-zero3"}


def test_a_semi_synchronous_candidate_is_planned_with_torchfts_state_not_the_plain_ddp_row(tmp_path):
    """The memory plan has a ``ddp`` row and a ``ddp-streaming-diloco`` row under one plan key; a streaming candidate
    is judged by its own: DDP's step plus the outer momentum (the recipe's ``momentum: 0.9``) and the pseudo-gradient
    in flight during its ``delay`` steps."""
    recipe = Recipe.read("cpu_smoke").config
    outer_sync = {"every": 4, "fragments": 2, "delay": 1, "momentum": 0.9}
    recipe["trainer"]["strategy"]["init_args"]["outer_sync"] = outer_sync
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    plan = MemoryPlan(Recipe.read(str(tmp_path / "recipe.yaml")), world_size=4, gpus_per_node=2, usable_bytes=64 * GiB)
    setups = all_setups()
    exact, _ = memory_verdict(Candidate(setups["ddp"]), plan)
    streaming, _ = memory_verdict(Candidate(setups["ddp-streaming-diloco"]), plan)
    rows = {row.name: row for row in plan.simulation(None).rows if row.activation_checkpointing == "none"}
    assert (exact, streaming) == (rows["ddp"].memory.peak, rows["ddp-streaming-diloco"].memory.peak)
    assert streaming > exact
