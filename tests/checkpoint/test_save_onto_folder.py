"""A save never deletes or replaces a folder the project did not write.

Lightning's contract, kept by both strategies: a single-file checkpoint onto a
folder raises ``IsADirectoryError``; a sharded checkpoint is written into the
folder and everything else there stays. Atomic replacement applies only to a
file or to a folder that holds a checkpoint and nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_fastdist.parallel.checkpoint.atomic import (
    LIGHTNING_METADATA,
    SHARD_INDEX,
    check_save_target,
    is_checkpoint_folder,
    publish,
    save_file_atomically,
    staging_path,
)
from tests.support.harness import run_function
from tests.support.workloads import make_trainer, repeated_batches, tiny_gpt

USER_FILE = "notes.txt"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"


def user_folder(parent: Path) -> Path:
    folder = parent / "exp1"
    folder.mkdir()
    (folder / USER_FILE).write_text("the user's own notes")
    return folder


def staged_checkpoint(target: Path, tag: str, shards: int = 2) -> Path:
    """A finished sharded save of ``target``, as the writer leaves it before publishing."""
    staged = staging_path(target)
    staged.mkdir()
    for rank in range(shards):
        (staged / f"__{rank}_0.distcp").write_text(f"{tag} shard {rank}")
    (staged / LIGHTNING_METADATA).write_text(f"{tag} meta")
    (staged / SHARD_INDEX).write_text(f"{tag} index")
    return staged


# ---------------------------------------------------------------- publishing, on real files


def test_a_file_onto_a_users_folder_is_refused_and_the_folder_kept(tmp_path):
    folder = user_folder(tmp_path)
    with pytest.raises(IsADirectoryError) as refused:
        save_file_atomically(lambda staged: staged.write_text("checkpoint"), folder)
    documented = (
        "The checkpoint path exists and is a directory: ",
        "not a checkpoint, and is never replaced. Save to a file inside it",
    )
    assert all(part in str(refused.value) and part in DOCS.read_text() for part in documented)
    assert "`full-checkpoint-onto-a-folder`" in DOCS.read_text()
    assert f"{folder} is a folder holding notes.txt, not a checkpoint" in str(refused.value)
    assert os.listdir(folder) == [USER_FILE] and (folder / USER_FILE).read_text() == "the user's own notes"
    assert sorted(os.listdir(tmp_path)) == ["exp1"]  # refused before writing: no staging file either


def test_an_empty_folder_is_not_a_checkpoint_either(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(IsADirectoryError, match="is an empty folder"):
        check_save_target(tmp_path / "empty", sharded=False)
    check_save_target(tmp_path / "empty", sharded=True)  # a sharded save writes into it


def test_a_sharded_save_merges_into_a_users_folder_and_replaces_only_its_own_files(tmp_path):
    folder = user_folder(tmp_path)
    publish(staged_checkpoint(folder, "first", shards=3), folder)
    assert not is_checkpoint_folder(folder)  # still the user's folder
    publish(staged_checkpoint(folder, "second", shards=2), folder)
    assert (folder / USER_FILE).read_text() == "the user's own notes"
    assert (folder / SHARD_INDEX).read_text() == "second index"
    assert [(folder / f"__{r}_0.distcp").read_text() for r in range(2)] == ["second shard 0", "second shard 1"]
    assert (folder / "__2_0.distcp").read_text() == "first shard 2"  # not named by the new index; never deleted
    assert sorted(os.listdir(tmp_path)) == ["exp1"]


def test_a_merge_that_fails_midway_leaves_a_folder_without_an_index(tmp_path):
    folder = user_folder(tmp_path)
    publish(staged_checkpoint(folder, "first"), folder)
    (folder / "__1_0.distcp").unlink()
    (folder / "__1_0.distcp").mkdir()  # a folder where the second shard must go: moving it fails
    with pytest.raises(OSError):
        publish(staged_checkpoint(folder, "second"), folder)
    assert not (folder / SHARD_INDEX).exists() and not (folder / LIGHTNING_METADATA).exists()
    assert (folder / USER_FILE).read_text() == "the user's own notes"


def test_a_checkpoint_folder_is_replaced_whole_by_a_file_or_a_folder(tmp_path):
    target = tmp_path / "step.ckpt"
    publish(staged_checkpoint(target, "first"), target)
    assert is_checkpoint_folder(target)
    publish(staged_checkpoint(target, "second", shards=1), target)
    assert sorted(os.listdir(target)) == [SHARD_INDEX, "__0_0.distcp", LIGHTNING_METADATA]
    save_file_atomically(lambda staged: staged.write_text("full"), target)
    assert target.read_text() == "full"
    assert sorted(os.listdir(tmp_path)) == ["step.ckpt"]  # no .partial, no .replaced left


def test_a_stale_staging_folder_with_other_files_is_not_deleted(tmp_path):
    target = tmp_path / "model.ckpt"
    staged = staging_path(target)
    staged.mkdir()
    (staged / "keep.txt").write_text("not ours")
    (staged / "__0_0.distcp").write_text("left by a crashed save")
    with pytest.raises(FileExistsError, match=r"keep.txt"):
        save_file_atomically(lambda path: path.write_text("full"), target)
    assert os.listdir(staged) == ["keep.txt"]


# ---------------------------------------------------------------- the strategies, through trainer.save_checkpoint


def save_into(kind: str, folder: str, saves: int, resume: bool = False) -> str | int:
    """Train one step, then ``trainer.save_checkpoint(folder)`` ``saves`` times.

    Returns the error's class or "saved"; with ``resume``, the step a new
    trainer reaches after resuming from ``folder`` and training one more step.
    """
    from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy

    def strategy():
        return FastDDPStrategy() if kind == "ddp" else FastFSDPStrategy(checkpoint_format=kind.removeprefix("fsdp-"))

    devices = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = make_trainer(strategy(), devices=devices, max_steps=1)
    trainer.fit(tiny_gpt(), repeated_batches())
    try:
        for _ in range(saves):
            trainer.save_checkpoint(folder)
    except IsADirectoryError:
        return "IsADirectoryError"
    if not resume:
        return "saved"
    resumed = make_trainer(strategy(), devices=devices, max_steps=2)
    resumed.fit(tiny_gpt(), repeated_batches(), ckpt_path=folder)
    return resumed.global_step


@pytest.mark.parametrize("kind", ["ddp", "fsdp-full"])
def test_a_full_checkpoint_onto_a_users_folder_raises_on_one_process(kind, tmp_path):
    folder = user_folder(tmp_path)
    assert save_into(kind, str(folder), saves=1) == "IsADirectoryError"
    assert os.listdir(folder) == [USER_FILE]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp-full"])
def test_a_full_checkpoint_onto_a_users_folder_raises_on_every_rank(kind, tmp_path):
    folder = user_folder(tmp_path)
    assert (
        run_function(save_into, 2, args=(kind, str(folder), 1), init_process_group=False, timeout=120)
        == ["IsADirectoryError"] * 2
    )
    assert os.listdir(folder) == [USER_FILE]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sharded_checkpoint_is_written_into_a_users_folder_and_resumes(tmp_path):
    folder = user_folder(tmp_path)
    steps = run_function(
        save_into, 2, args=("fsdp-sharded", str(folder), 2, True), init_process_group=False, timeout=120
    )
    assert steps == [2, 2]  # resumed at step 1 from the folder, trained step 2
    assert (folder / USER_FILE).read_text() == "the user's own notes"
    assert {SHARD_INDEX, LIGHTNING_METADATA, USER_FILE} <= set(os.listdir(folder))
    dcp.FileSystemReader(folder).read_metadata()  # the second save's index is complete
    assert torch.load(folder / LIGHTNING_METADATA, weights_only=False)["global_step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["exp1"]
