"""benchmarks/gpu_bench.sh and gpu_bench.py without a GPU: nothing fetched, the rows and a lever on a tiny shape.

The slow test runs the script for real on the CPU (``--device cpu``): the four rows train the same tiny model on the
same batches (so their losses agree), fp8 is refused in its one line, the CUDA-only levers say why they are skipped,
and the report, the plot, the best recipe and the profile are written.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.offline_gpu_script import load_driver, offline_environment, shell_commands

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_bench.sh"


def test_every_pip_install_is_offline_and_nothing_else_fetches():
    commands = shell_commands(SCRIPT)
    installs = [command for command in commands if "pip install" in command]
    assert installs and all("--no-index" in command and "--no-deps" in command for command in installs)
    assert not [c for c in commands if re.search(r"\b(pip download|curl|wget|git clone)\b", c)]
    assert "pip" not in (ROOT / "benchmarks" / "gpu_bench.py").read_text()


def test_the_driver_lists_rows_and_levers_and_refuses_an_unknown_lever_in_one_line(capsys):
    driver = load_driver("gpu_bench")
    assert driver.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert listed.startswith("rows: lightning-ddp, fast-default, recipe, hand-loop\n")
    for lever in ("micro_batch", "compile_scope", "loss_path", "fuse_optimizers", "attention", "fp8", "cuda_graphs",
                  "compile_mode"):  # fmt: skip
        assert f"lever {lever}:" in listed
    assert driver.main(["--device", "cpu", "--levers", "loss_path,warp"]) == 2
    assert capsys.readouterr().out.startswith("--levers: unknown warp; the levers: micro_batch, compile_scope")


def test_the_recipe_of_a_setting_keeps_the_global_batch_and_sets_each_lever():
    driver = load_driver("gpu_bench")
    shape = driver.SHAPES["gpt2-small"]
    levers = dict(compile_scope="model", loss_path="chunked", fuse_optimizers="always", attention="cudnn")
    setting = driver.Setting(micro_batch=64, fp8="tensorwise", compile_mode="max-autotune-no-cudagraphs", **levers)
    recipe = driver.recipe_for(setting, shape, "cuda")
    trainer, model = recipe["trainer"], recipe["model"]["init_args"]
    assert recipe["data"]["init_args"]["batch_size"] * trainer["accumulate_grad_batches"] == shape.global_batch == 64
    assert trainer["strategy"]["init_args"]["compile"] == {"mode": "max-autotune-no-cudagraphs"}
    assert trainer["strategy"]["init_args"]["compile_scope"] == "model"
    assert trainer["plugins"][0]["init_args"] == {"precision": "bf16-mixed", "fuse_optimizers": "always",
                                                  "fp8": "tensorwise"}  # fmt: skip
    assert (model["n_embd"], model["block_size"], model["vocab_size"]) == (768, 1024, 50304)
    assert (model["loss_path"], model["attention"]) == ("chunked", "cudnn")
    assert driver.recipe_for(driver.Setting(), driver.SHAPES["tiny"], "cpu")["trainer"]["strategy"]["init_args"][
        "compile"
    ] == {"backend": "eager"}  # inductor costs ~15 s a graph on this CPU


@pytest.mark.slow
def test_the_script_runs_the_rows_and_a_lever_on_cpu_offline_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    environment, probe = offline_environment(tmp_path)
    command = ["bash", str(SCRIPT), "--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"),
               "--levers", "fp8,attention"]  # fmt: skip
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (probe / "__init__.py").exists()  # installed with --no-index
    report = json.loads((out / "gpu_bench.json").read_text())
    rows = {row["label"]: row for row in report["rows"]}
    assert list(rows) == ["lightning-ddp", "fast-default", "recipe", "hand-loop"]
    for label, row in rows.items():
        # The same model, data, seed and global batch (4 x 4 sequences of 32 tokens), bf16 autocast on the CPU.
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(4 * 4 * 32), label
        assert row["tail_loss"] == pytest.approx(rows["hand-loop"]["tail_loss"], abs=1e-3), label
        assert row["host_syncs_per_step"] == 0, label
    levers = {row["label"]: row for row in report["levers"]}
    assert levers["fp8=tensorwise"]["skipped"].startswith(
        "FastMixedPrecision: fp8='tensorwise' is refused: fp8 matmuls need a CUDA GPU of compute capability 8.9"
    )
    assert levers["attention=cudnn"]["skipped"] == "needs CUDA: the SDPA kernels compared are CUDA's"
    assert report["best_row"]["label"] == "recipe"  # nothing ran that could beat it
    assert set(report["goals"]) >= {"default_vs_lightning_ddp (>= 2.5)", "best_vs_hand_loop (>= 0.97)"}
    best = yaml.safe_load((out / "recipe_best.yaml").read_text())
    assert best["trainer"]["strategy"]["init_args"]["compile_scope"] == "blocks"
    assert (out / "best.ops.txt").read_text().count("aten::") > 5  # the profile of the best setting
    assert (out / "best.trace.json.gz").stat().st_size > 1000 and (out / "gpu_bench.png").stat().st_size > 10_000
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back from $OUT
    assert "[fp8=tensorwise] skipped: FastMixedPrecision: fp8='tensorwise' is refused" in done.stdout
