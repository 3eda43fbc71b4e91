"""Every row of docs/bad-inputs.md, executed: each bad input ends with one clear message naming the field.

Rows given through the command line or a recipe run ``lightning-fastdist fit``
in this process and must exit with status 2 and exactly one ``error:`` line
(no traceback) before any training process starts. The few mistakes that can
only be seen with the model or the data in hand raise one exception naming the
field when training sets up. The documented message of every row must appear
in docs/bad-inputs.md, so the table and the code cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from lightning_fastdist.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
BASE = {
    "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "max_steps": 1, "enable_progress_bar": False,
                "enable_checkpointing": False, "enable_model_summary": False, "limit_val_batches": 0},
    "model": {"class_path": "lightning_fastdist.demo.TinyGPT",
              "init_args": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}},
    "data": {"class_path": "lightning_fastdist.demo.TextDataModule", "init_args": {"batch_size": 2, "block_size": 16}},
}  # fmt: skip


@dataclass
class Row:
    """One bad input: a recipe (merged over ``BASE``) or raw arguments, and the message it must produce."""

    id: str
    message: str
    recipe: dict = field(default_factory=dict)
    args: list[str] | None = None  # used instead of a recipe
    raises: type[Exception] | None = None  # seen at setup (needs the model or data): this exception


def strategy(cls: str, **init_args) -> dict:
    return {"trainer": {"strategy": {"class_path": f"lightning_fastdist.{cls}", "init_args": init_args}}}


def model(**init_args) -> dict:
    return {"model": {"init_args": init_args}}


def data(**init_args) -> dict:
    return {"data": {"init_args": init_args}}


def plugin(**init_args) -> dict:
    return {"trainer": {"plugins": [{"class_path": "lightning_fastdist.FastMixedPrecision", "init_args": init_args}]}}


def another_model(class_path: str) -> dict:
    return {"model": {"class_path": class_path}}


def merge(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, mapping by mapping; a mapping that names another ``class_path`` replaces the one in
    ``base`` whole (the ``init_args`` there belong to the other class)."""
    merged = dict(base)
    for key, value in extra.items():
        below = merged.get(key)
        if isinstance(value, dict) and isinstance(below, dict) and not _names_another_class(value, below):
            merged[key] = merge(below, value)
        else:
            merged[key] = value
    return merged


def _names_another_class(value: dict, below: dict) -> bool:
    return "class_path" in value and value["class_path"] != below.get("class_path")


ROWS = [
    Row("unknown-comm-hook",
        ("Parser key \"comm_hook\": Expected a typing.Literal['auto', 'none', 'fp16', 'bf16', 'powersgd']. "
         "Got value: fp8"),
        strategy("FastDDPStrategy", comm_hook="fp8")),
    Row("powersgd-rank-zero", "FastDDPStrategy: powersgd_rank must be an integer >= 1, got 0.",
        strategy("FastDDPStrategy", powersgd_rank=0)),
    Row("negative-bucket", "FastDDPStrategy: bucket_cap_mb must be a finite number > 0 or 'auto', got -5.0.",
        strategy("FastDDPStrategy", bucket_cap_mb=-5)),
    Row("bf16-hook-on-mpi", "FastDDPStrategy: comm_hook='bf16' needs process_group_backend in 'gloo', 'nccl'",
        strategy("FastDDPStrategy", comm_hook="bf16", process_group_backend="mpi")),
    Row("negative-timeout",
        "FastDDPStrategy: timeout must be a finite number of seconds > 0 (or a timedelta), got -1.0.",
        strategy("FastDDPStrategy", timeout=-1)),
    Row("timeout-wrong-type", 'Parser key "timeout": Expected a <class \'float\'>',
        strategy("FastFSDPStrategy", timeout="soon")),
    Row("unknown-sharding",
        "Parser key \"sharding\": Expected a typing.Literal['zero3', 'zero2', 'hsdp']. Got value: zero4",
        strategy("FastFSDPStrategy", sharding="zero4")),
    Row("hsdp-group-does-not-divide", "hsdp_group_size: 3 does not divide the world size 2; use one of 1, 2.",
        {**strategy("FastFSDPStrategy", sharding="hsdp", hsdp_group_size=3),
         "trainer": {**strategy("FastFSDPStrategy", sharding="hsdp", hsdp_group_size=3)["trainer"], "devices": 2}}),
    Row("unknown-checkpoint-format",
        "Parser key \"checkpoint_format\": Expected a typing.Literal['sharded', 'full']. Got value: zip",
        strategy("FastFSDPStrategy", checkpoint_format="zip")),
    Row("async-checkpointing-not-a-bool",
        'Parser key "async_checkpointing": Expected a <class \'bool\'>. Got value: sometimes',
        strategy("FastDeepSpeedStrategy", async_checkpointing="sometimes")),
    Row("unknown-activation-checkpointing",
        'Parser key "activation_checkpointing": Expected a typing.Literal[\'none\', \'full\', \'selective\']',
        strategy("FastDDPStrategy", activation_checkpointing="partial")),
    Row("unknown-compile-backend", "compile.backend: 'tensorrtx' is not a torch.compile backend; accepted: ",
        strategy("FastDDPStrategy", compile={"backend": "tensorrtx"})),
    Row("unknown-compile-mode",
        ("compile.mode: 'fastest' is not a torch.compile mode; "
         "accepted: default, max-autotune-no-cudagraphs."),
        strategy("FastFSDPStrategy", compile={"mode": "fastest"})),
    Row("cuda-graph-compile-mode",
        ("compile: mode='reduce-overhead' records CUDA graphs, which per-block compile, activation checkpointing "
         "and FSDP's re-allocated weights break on replay; use mode='max-autotune-no-cudagraphs' (or the default "
         "mode)."),
        strategy("FastDDPStrategy", compile={"mode": "reduce-overhead"})),
    Row("unknown-compile-option",
        "compile: unknown option(s) opt_level; accepted: backend, mode, fullgraph, dynamic, options.",
        strategy("FastDDPStrategy", compile={"opt_level": 3})),
    Row("unknown-compile-scope",
        "Parser key \"compile_scope\": Expected a typing.Literal['blocks', 'model']. Got value: layers",
        strategy("FastDDPStrategy", compile=True, compile_scope="layers")),
    Row("unknown-strategy-name", "You selected an invalid strategy name: `strategy='fast_dpp'`",
        {"trainer": {"strategy": "fast_dpp"}}),
    Row("fp16-on-cpu", "FastMixedPrecision: precision='16-mixed' is refused on device='cpu'",
        plugin(precision="16-mixed", device="cpu")),
    Row("unknown-precision",
        "FastMixedPrecision: precision must be one of ('bf16-mixed', '16-mixed', 'bf16-true'), got 'fp8'.",
        plugin(precision="fp8")),
    Row("wrong-type-in-yaml",
        ("model: Problem with given class_path 'lightning_fastdist.demo.TinyGPT': "
         'Parser key "n_layer": Expected a <class \'int\'>. Got value: four'),
        model(n_layer="four")),
    Row("heads-do-not-divide-width", "TinyGPT: n_embd (30) must be divisible by n_head (4).",
        model(n_embd=30, n_head=4)),
    Row("zero-layers", "TinyGPT: n_layer must be >= 1, got 0.", model(n_layer=0)),
    Row("misspelt-option",
        "model: Problem with given class_path 'lightning_fastdist.demo.TinyGPT': Option 'n_layr' is not accepted",
        model(n_layr=2)),
    Row("zero-batch-size", "TextDataModule: batch_size must be >= 1, got 0.", data(batch_size=0)),
    Row("impossible-validation-share", "TextDataModule: val_fraction must be in (0, 0.5], got 0.9.",
        data(val_fraction=0.9)),
    Row("trainer-wrong-type", "trainer.max_steps: Expected a <class 'int'>. Got value: lots",
        {"trainer": {"max_steps": "lots"}}),
    Row("devices-not-a-number", "`devices` selected with `CPUAccelerator` should be an int > 0.",
        {"trainer": {"devices": "two"}}),
    Row("unknown-nonfinite-action",
        "Parser key \"action\": Expected a typing.Literal['skip', 'stop', 'off']. Got value: ignore",
        {"trainer": {"callbacks": [{"class_path": "lightning_fastdist.NonFiniteLoss",
                                    "init_args": {"action": "ignore"}}]}}),
    Row("missing-recipe-file", "--config: recipe file 'no_such_recipe.yaml' not found.",
        args=["fit", "--config", "no_such_recipe.yaml"]),
    Row("recipe-not-yaml", "is not valid YAML at line 2, column 1", args=["fit", "--config", "broken.yaml"]),
    Row("recipe-not-a-mapping", "must hold a mapping of options (trainer:, model:, data:, ...), got a list.",
        args=["fit", "--config", "list.yaml"]),
    Row("unknown-command", "unknown command 'trian'; choose from fit, validate, test, predict", args=["trian"]),
    Row("shard-class-matches-nothing", "blocks: 'Blok' matches no module class in TinyGPT; the classes found are: ",
        strategy("FastFSDPStrategy", blocks=["Blok"])),
    Row("fsdp-manual-optimization-without-blocks",
        ("blocks: under manual optimization GAN needs blocks (a backward inside the step does not reduce a model "
         "sharded as one unit), and none were found; use blocks: [Sequential]."),
        merge(strategy("FastFSDPStrategy"), another_model("tests.fsdp.test_fsdp_manual_optimization.GAN"))),
    Row("keep-fp32-class-matches-nothing", "keep_fp32: 'Rooter' matches no module class in TinyGPT; the classes found",
        strategy("FastFSDPStrategy", keep_fp32=["Rooter"])),
    Row("missing-corpus-file", "TextDataModule: corpus_path '/no/such/corpus.txt' is not a readable file.",
        data(corpus_path="/no/such/corpus.txt"), raises=FileNotFoundError),
    Row("bf16-factors-on-mpi",
        "FastDDPStrategy: powersgd_factor_dtype='bf16' needs process_group_backend in 'gloo', 'nccl'",
        strategy("FastDDPStrategy", comm_hook="powersgd", powersgd_factor_dtype="bf16", process_group_backend="mpi")),
    Row("infinite-bucket", "FastDDPStrategy: bucket_cap_mb must be a finite number > 0 or 'auto', got inf.",
        strategy("FastDDPStrategy", bucket_cap_mb=float("inf"))),
    Row("nan-bucket", "FastDDPStrategy: bucket_cap_mb must be a finite number > 0 or 'auto', got nan.",
        strategy("FastDDPStrategy", bucket_cap_mb=float("nan"))),
    Row("infinite-timeout",
        "FastFSDPStrategy: timeout must be a finite number of seconds > 0 (or a timedelta), got inf.",
        strategy("FastFSDPStrategy", timeout=float("inf"))),
    Row("hsdp-group-without-hsdp",
        "hsdp_group_size: only used with sharding='hsdp', got sharding='zero3'; remove it or use 'hsdp'.",
        strategy("FastFSDPStrategy", sharding="zero3", hsdp_group_size=2)),
    Row("fullgraph-not-a-bool", "compile.fullgraph: expected true or false; got 'always'.",
        strategy("FastDDPStrategy", compile={"fullgraph": "always"})),
    Row("checkpoint-every-nth-beyond-blocks",
        ("activation_checkpointing=999: TinyGPT has 1 block(s), so no block would be checkpointed; "
         "use an integer from 1 to 1"),
        strategy("FastDDPStrategy", activation_checkpointing=999), raises=ValueError),
    Row("ddp-comm-hook-callable",
        ("FastDDPStrategy: ddp_comm_hook is not taken; "
         "name the hook instead: comm_hook='fp16', 'bf16', 'powersgd' or 'none'"),
        strategy("FastDDPStrategy",
                 ddp_comm_hook="torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook")),
    Row("unknown-ddp-argument",
        "Problem with given class_path 'lightning_fastdist.FastDDPStrategy': Option 'broadcast_bufers' is not accepted",
        strategy("FastDDPStrategy", broadcast_bufers=False)),
    Row("blocks-not-a-list",
        "Parser key \"blocks\": Expected a typing.Literal['auto']; Expected a <class 'list'>; Given value: Block",
        strategy("FastDDPStrategy", blocks="Block")),
    Row("blocks-and-its-old-name", "FastFSDPStrategy: shard_modules is the old name of blocks; give blocks only.",
        strategy("FastFSDPStrategy", blocks=["Block"], shard_modules=["Block"])),
    Row("deepspeed-unknown-stage", "Parser key \"stage\": Expected a typing.Literal[1, 2, 3]. Got value: 4",
        strategy("FastDeepSpeedStrategy", stage=4)),
    Row("deepspeed-offload-parameters-below-stage-3",
        ("offload_parameters: needs stage=3 (parameters are only partitioned at stage 3), got stage=2; "
         "offload_optimizer works at every stage."),
        strategy("FastDeepSpeedStrategy", stage=2, offload_parameters=True)),
    Row("deepspeed-bucket-size", "reduce_bucket_size: got 0; use 'auto' or a number of elements >= 1.",
        strategy("FastDeepSpeedStrategy", reduce_bucket_size=0)),
    Row("deepspeed-precision-plugin",
        ("FastDeepSpeedStrategy: precision comes from Trainer(precision=...), which DeepSpeed runs itself; "
         "remove the FastMixedPrecision plugin."),
        merge(strategy("FastDeepSpeedStrategy"), plugin(precision="bf16-mixed"))),
    Row("outer-sync-every-zero", "outer_sync.every=0 must be an integer >= 1.",
        strategy("FastDDPStrategy", outer_sync={"every": 0})),
    Row("outer-sync-every-not-a-multiple",
        "outer_sync.every=5 is not a multiple of outer_sync.fragments=2",
        strategy("FastDDPStrategy", outer_sync={"every": 5, "fragments": 2})),
    Row("outer-sync-lr-zero", "outer_sync.lr=0.0 must be > 0 (DiLoCo uses 0.7).",
        strategy("FastDDPStrategy", outer_sync={"lr": 0.0})),
    Row("outer-sync-on-one-node",
        "FastDDPStrategy: outer_sync synchronises across nodes and this job has num_nodes=1",
        strategy("FastDDPStrategy", outer_sync={"every": 4})),
    Row("outer-sync-fragments-do-not-divide-blocks",
        "outer_sync.fragments=3 does not divide the model's 2 blocks: give a divisor of 2",
        merge(strategy("FastDDPStrategy", outer_sync={"every": 6, "fragments": 3}),
              {"model": {"init_args": {"n_layer": 2}}, "trainer": {"num_nodes": 2, "devices": 1}})),
    Row("outer-sync-min-nodes-above-num-nodes",
        "FastDDPStrategy: outer_sync.min_nodes=3 is more than the job's num_nodes=2: give min_nodes 1 to 2",
        merge(strategy("FastDDPStrategy", outer_sync={"every": 4, "min_nodes": 3}),
              {"trainer": {"num_nodes": 2, "devices": 1}})),
    Row("outer-sync-fsdp-hsdp",
        "FastFSDPStrategy: outer_sync synchronises across nodes every `every` steps and sharding='hsdp' every step",
        strategy("FastFSDPStrategy", sharding="hsdp", outer_sync={"every": 4})),
    Row("replica-groups-min-nodes-zero", "replica_groups.min_nodes=0 must be an integer >= 1.",
        strategy("FastDDPStrategy", replica_groups={"min_nodes": 0})),
    Row("replica-groups-and-outer-sync",
        "FastDDPStrategy: outer_sync and replica_groups are two forms of training across nodes: give one",
        strategy("FastDDPStrategy", replica_groups={"min_nodes": 1}, outer_sync={"every": 4})),
    Row("replica-groups-on-one-node",
        "FastDDPStrategy: replica_groups synchronises across nodes and this job has num_nodes=1",
        strategy("FastDDPStrategy", replica_groups={"min_nodes": 1})),
    Row("replica-groups-fsdp-hsdp",
        "FastFSDPStrategy: replica_groups replicates across nodes through torchft, as sharding='hsdp' does through one",
        strategy("FastFSDPStrategy", sharding="hsdp", replica_groups={"min_nodes": 1})),
    Row("fp8-without-a-gpu",
        "FastMixedPrecision: fp8='tensorwise' is refused: fp8 matmuls need a CUDA GPU of compute capability 8.9",
        plugin(fp8="tensorwise")),
    Row("fp8-unknown-recipe", "FastMixedPrecision: fp8 must be null or one of tensorwise, rowwise; got 'blockwise'.",
        plugin(fp8="blockwise")),
    Row("fuse-optimizers-unknown",
        "FastMixedPrecision: fuse_optimizers must be one of true, false, 'always'; got 'sometimes'.",
        plugin(fuse_optimizers="sometimes")),
    Row("demo-loss-path-unknown", "TinyGPT: loss_path must be one of full, chunked; got 'fast'.",
        model(loss_path="fast")),
    Row("demo-attention-unknown", "TinyGPT: attention must be one of auto, flash, cudnn, efficient, math; got 'turbo'.",
        model(attention="turbo")),
    Row("deepspeed-sync-batchnorm",
        ("FastDeepSpeedStrategy: sync_batchnorm=True is not honoured by DeepSpeed's engine, which never converts "
         "BatchNorm layers; use FastDDPStrategy or FastFSDPStrategy, or remove sync_batchnorm."),
        merge(strategy("FastDeepSpeedStrategy"), {"trainer": {"sync_batchnorm": True}})),
    Row("deepspeed-fp16-true",
        ("FastDeepSpeedStrategy: precision='16-true' (fp16 weights, no loss scaling) is not what DeepSpeed's fp16 "
         "computes"),
        merge(strategy("FastDeepSpeedStrategy"), {"trainer": {"precision": "16-true"}})),
]  # fmt: skip


def arguments(row: Row, folder: Path) -> list[str]:
    if row.args is not None:
        (folder / "broken.yaml").write_text("trainer:\n\tdevices: 2\n")
        (folder / "list.yaml").write_text("- trainer\n- model\n")
        return row.args
    (folder / "recipe.yaml").write_text(yaml.safe_dump(merge(BASE, row.recipe)))
    return ["fit", "--config", str(folder / "recipe.yaml")]


def test_the_table_has_at_least_20_rows_and_documents_every_message():
    assert len(ROWS) >= 20 and len({row.id for row in ROWS}) == len(ROWS)
    page = DOCS.read_text()
    missing = [row.id for row in ROWS if f"`{row.id}`" not in page or row.message not in page]
    assert not missing, f"rows missing from docs/bad-inputs.md (id or message): {missing}"


@pytest.mark.parametrize("row", [r for r in ROWS if r.raises is None], ids=lambda r: r.id)
def test_bad_input_exits_2_with_one_line_naming_the_field(row, in_tmp_dir, capsys):
    with pytest.raises(SystemExit) as stop:
        main(arguments(row, in_tmp_dir))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning-fastdist: error:")]
    assert stop.value.code == 2
    assert len(errors) == 1 and row.message in errors[0], errors


@pytest.mark.parametrize("row", [r for r in ROWS if r.raises is not None], ids=lambda r: r.id)
def test_bad_input_seen_at_setup_raises_one_error_naming_the_field(row, in_tmp_dir):
    with pytest.raises(row.raises) as error:
        main(arguments(row, in_tmp_dir))
    assert row.message in str(error.value)


def test_a_bug_in_the_users_own_init_keeps_its_traceback_where_a_libraries_check_is_one_line(in_tmp_dir, capsys):
    (in_tmp_dir / "users_own_model.py").write_text(
        "import lightning as L\n\n\nclass Broken(L.LightningModule):\n    def __init__(self, width: int = 4):\n"
        "        super().__init__()\n        raise ValueError('a bug on line 7')\n"
    )
    config = in_tmp_dir / "recipe.yaml"
    config.write_text(yaml.safe_dump(merge(BASE, another_model("users_own_model.Broken"))))
    with pytest.raises(ValueError, match="a bug on line 7") as raised:
        main(["fit", "--config", str(config)])
    assert raised.traceback[-1].path == in_tmp_dir / "users_own_model.py" and raised.traceback[-1].lineno + 1 == 7
    assert "error:" not in capsys.readouterr().err  # not turned into a line that hides where it failed
