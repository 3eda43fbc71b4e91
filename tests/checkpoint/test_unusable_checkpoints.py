"""A checkpoint that cannot be loaded ends in one line naming the file; ``--ckpt_path last`` falls back.

Each case trains 4 steps with ``lightning-fastdist fit`` (one CPU process,
checkpoints at steps 2 and 4 plus ``last.ckpt``), damages a copy of the
checkpoint folder the way a crash, a full disk or a wrong path would, and
resumes from it: an explicit path exits 1 with exactly one error line that
names the file and the problem (no traceback); a damaged ``last.ckpt``
(``--ckpt_path last``) is replaced by the newest checkpoint that loads, with a
warning.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fastdist.cli import main
from lightning_fastdist.parallel.checkpoint.problems import describe_unloadable
from tests.support.fault_runs import BATCH, BLOCK, write_corpus

STRATEGIES = {"ddp": "lightning_fastdist.FastDDPStrategy", "fsdp": "lightning_fastdist.FastFSDPStrategy"}


def write_one_process_recipe(folder: Path, kind: str) -> Path:
    recipe = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 4, "logger": False, "enable_progress_bar": False,
            "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
            "strategy": {"class_path": STRATEGIES[kind], "init_args": {"timeout": 60}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                "dirpath": str(folder / "checkpoints"), "every_n_train_steps": 2, "save_top_k": -1,
                "save_last": True}}],
        },
        "model": {"class_path": "lightning_fastdist.demo.TinyGPT",
                  "init_args": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": BLOCK, "warmup_steps": 0}},
        "data": {"class_path": "lightning_fastdist.demo.TextDataModule",
                 "init_args": {"batch_size": BATCH, "block_size": BLOCK,
                               "corpus_path": str(write_corpus(folder / "corpus.bin", world_size=1))}},
    }  # fmt: skip
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module", params=sorted(STRATEGIES))
def trained(request, tmp_path_factory) -> tuple[str, Path]:
    """A recipe and the checkpoints of its first 4 steps.

    The checkpoints are ``epoch=0-step=2.ckpt``, ``...step=4.ckpt`` and ``last.ckpt``.
    """
    folder = tmp_path_factory.mktemp(request.param)
    recipe = write_one_process_recipe(folder, request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)  # the resolved config is written into the working directory
        main(["fit", "--config", str(recipe)])
    return request.param, folder


def truncate(path: Path) -> None:
    if path.is_dir():
        path = max(path.glob("*.distcp"), key=lambda shard: shard.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def remove_a_shard(path: Path) -> None:
    next(path.glob("*.distcp")).unlink()


def remove_metadata(path: Path) -> None:
    (path / ".metadata").unlink()


STEP_4 = "epoch=0-step=4.ckpt"


def resume(
    trained: tuple[str, Path], damage: Callable[[Path], None], damaged: str, ckpt_path: str, workdir: Path, capsys
) -> tuple[int, str]:
    """Damage checkpoint ``damaged`` in a copy of the checkpoints, resume to step 6; return (exit status, stderr)."""
    _, folder = trained
    copy = workdir / "checkpoints"
    shutil.copytree(folder / "checkpoints", copy)
    damage(copy / damaged)
    capsys.readouterr()
    args = ["fit", "--config", str(folder / "recipe.yaml"), "--trainer.max_steps", "6",
            "--trainer.callbacks.init_args.dirpath", str(copy), "--ckpt_path", ckpt_path]  # fmt: skip
    try:
        main(args)
        status = 0
    except SystemExit as stop:
        status = stop.code
    return status, capsys.readouterr().err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lightning-fastdist: error:")]


def test_a_truncated_checkpoint_given_by_path_is_one_line(trained, in_tmp_dir, capsys):
    status, stderr = resume(trained, truncate, STEP_4, str(in_tmp_dir / "checkpoints" / STEP_4), in_tmp_dir, capsys)
    expected = "is truncated or damaged" if trained[0] == "ddp" else "has a truncated shard __0_0.distcp"
    assert status == 1 and "Traceback" not in stderr
    assert len(error_lines(stderr)) == 1 and f"{STEP_4}' " in error_lines(stderr)[0] and expected in stderr, stderr[
        -2000:
    ]


def test_a_damaged_last_checkpoint_falls_back_to_the_newest_that_loads(trained, in_tmp_dir, capsys):
    damage = truncate if trained[0] == "ddp" else remove_a_shard
    with pytest.warns(UserWarning, match=r"last.ckpt' .* Resuming from '.*epoch=0-step=4.ckpt' instead"):
        status, stderr = resume(trained, damage, "last.ckpt", "last", in_tmp_dir, capsys)
    assert status == 0, stderr[-3000:]
    # Lightning keeps the damaged last.ckpt (not its own) and writes last-v1.ckpt, which "last" finds next time.
    newest = max((in_tmp_dir / "checkpoints").glob("last*.ckpt"), key=lambda path: path.stat().st_mtime)
    meta = torch.load(newest / "meta.pt" if newest.is_dir() else newest, map_location="cpu", weights_only=False)
    assert newest.name == "last-v1.ckpt" and meta["global_step"] == 6


@pytest.mark.parametrize("trained", ["fsdp"], indirect=True)  # sharded folders are FastFSDPStrategy's
@pytest.mark.parametrize(
    ("damage", "expected"),
    [(remove_a_shard, "is missing its shard __0_0.distcp"), (remove_metadata, "has no .metadata file")],
    ids=["missing-shard", "missing-metadata"],
)
def test_a_broken_sharded_folder_is_one_line_naming_what_is_missing(trained, in_tmp_dir, capsys, damage, expected):
    status, stderr = resume(trained, damage, STEP_4, str(in_tmp_dir / "checkpoints" / STEP_4), in_tmp_dir, capsys)
    assert status == 1 and "Traceback" not in stderr
    assert len(error_lines(stderr)) == 1 and expected in error_lines(stderr)[0], stderr[-2000:]


def test_a_missing_file_a_folder_or_a_text_file_is_named_as_such(in_tmp_dir):
    (in_tmp_dir / "runs").mkdir()
    assert describe_unloadable(in_tmp_dir / "nothing.ckpt", FileNotFoundError()).endswith(
        "nothing.ckpt' does not exist."
    )
    assert "is a folder, not a checkpoint file" in describe_unloadable(in_tmp_dir / "runs", IsADirectoryError(), False)
    (in_tmp_dir / "notes.ckpt").write_text("trainer:\n  devices: 2\n")
    assert "is not a torch checkpoint (it starts with 'trai'" in describe_unloadable(
        in_tmp_dir / "notes.ckpt", IndexError()
    )


def test_a_deepspeed_folder_is_read_as_deepspeeds_layout_not_as_a_sharded_folder(in_tmp_dir):
    folder = in_tmp_dir / "last.ckpt"
    folder.mkdir()
    (folder / "latest").write_text("checkpoint")
    assert describe_unloadable(folder, KeyError("module"), True).endswith(
        "last.ckpt' (a DeepSpeed folder) names its states folder 'checkpoint' in latest, and it is missing."
    )
    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert describe_unloadable(folder, KeyError("module"), True).endswith(
        "last.ckpt' (a DeepSpeed folder written at ZeRO stage 1 or 2) cannot be loaded: KeyError: 'module'."
    )


def test_a_sharded_load_that_fails_keeps_torchs_reason_from_the_first_rank_that_failed(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_fastdist.parallel.checkpoint.problems import describe_unloadable

    checkpoint = tmp_path / "step=3.ckpt"
    torch.save({"state_dict": {}}, checkpoint)  # a sound file: the line gives the load's own reason
    missing = RuntimeError("Missing key in checkpoint state_dict: optimizer_0.param_groups.0.initial_lr.")
    failures = {2: (KeyError("optimizer_1"), None), 1: (missing, None)}
    line = describe_unloadable(checkpoint, CheckpointException("CheckpointException ranks:dict_keys([1, 2])", failures))
    assert line == (
        f"checkpoint '{checkpoint}' cannot be loaded: RuntimeError: Missing key in checkpoint state_dict: "
        "optimizer_0.param_groups.0.initial_lr. (rank 1)."
    )
