"""lightning-fastdist bench: argument checks, and a real side-by-side run on 2 CPU processes."""

from __future__ import annotations

import json

import pytest

from lightning_fastdist.commands.bench import main
from lightning_fastdist.parallel.buckets import gradient_bytes
from lightning_fastdist.demo import TinyGPT
from tests.harness import cli_command, run_launcher


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--setups", "ddp,zero4"], "--setups: unknown zero4; known: ddp, ddp-fp16"),
        (["--steps", "5"], "--steps: must be >= 6"),
        (["--config", "nope.yaml"], "--config: recipe file 'nope.yaml' not found"),
    ],
)
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_compares_setups_and_writes_json_and_plot_and_nothing_else(in_tmp_dir):
    users = "# the user's own config, with comments\ntrainer: {max_steps: 3}\n"
    (in_tmp_dir / "config.yaml").write_text(users)
    model_args = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
                  "--data.block_size", "32", "--data.batch_size", "4"]  # fmt: skip
    result = run_launcher(
        cli_command("bench", "--steps", "7", "--setups", "ddp,ddp-fp16,fsdp-zero3,deepspeed-zero3", "--", *model_args),
        timeout=300,
    )
    assert "setup" in result.stdout and "ddp-fp16" in result.stdout
    rows = {row["setup"]: row for row in json.loads((in_tmp_dir / "bench_results" / "bench.json").read_text())}
    assert set(rows) == {"ddp", "ddp-fp16", "fsdp-zero3", "deepspeed-zero3"}
    model = TinyGPT(n_layer=2, n_head=2, n_embd=32, block_size=32)
    full = gradient_bytes(model)
    root = full - gradient_bytes(model.blocks)  # embeddings and final norm, outside the blocks
    assert rows["ddp"]["comm_bytes_per_step"] == full
    assert rows["ddp-fp16"]["comm_bytes_per_step"] == full // 2
    # ZeRO-3 gathers the blocks for forward and again for backward, the root once; reduce-scatters every gradient.
    assert rows["fsdp-zero3"]["comm_bytes_by_collective"] == {"allgather": 2 * full - root, "reduce_scatter": full}
    for name in ("ddp", "ddp-fp16", "fsdp-zero3"):
        assert rows[name]["steps"] == 7 and rows[name]["final_loss"] > 0
        assert rows[name]["tokens_per_s"] == pytest.approx(32 * rows[name]["samples_per_s"])  # 32-token sequences
        assert rows[name]["host_syncs_per_step"] == 0  # SyncFreeLogging; steps 4 and 5 are not logging steps
    assert "deepspeed" in rows["deepspeed-zero3"]["skipped"].lower()
    assert (in_tmp_dir / "bench_results" / "bench.png").stat().st_size > 10_000
    assert sorted(p.name for p in in_tmp_dir.iterdir()) == ["bench_results", "config.yaml"]
    assert (in_tmp_dir / "config.yaml").read_text() == users
