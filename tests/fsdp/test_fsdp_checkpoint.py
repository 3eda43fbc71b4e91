"""FastFSDPStrategy checkpoints on disk: save at 2 ranks, resume at 1 and 2; a failed write harms nothing (a save killed
midway, synchronous or in the background: ``tests/checkpoint/test_atomic_last.py``, ``test_async_checkpoints.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist.parallel.checkpoint.atomic import publish, save_file_atomically, staging_path
from tests.support.harness import run_function
from tests.support.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt

SAVE_FORMATS = {
    # Sharded and written in the background by a model with activation checkpointing,
    # resumed without it: checkpoints do not depend on either.
    "sharded-async": dict(checkpoint_format="sharded", async_checkpointing=True, activation_checkpointing="full"),
    "full": dict(checkpoint_format="full"),
}


def train_with_checkpoints(folder: str, options: dict, max_steps: int, resume_from: str | None = None) -> list[float]:
    """Train on repeated batches, saving every step into ``folder``/checkpoints; return this rank's losses."""
    from lightning_fastdist import FastFSDPStrategy

    checkpoints = ModelCheckpoint(Path(folder, "checkpoints"), "{step}", every_n_train_steps=1, save_top_k=-1)
    losses = LossRecorder()
    trainer = make_trainer(
        FastFSDPStrategy(**options),
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[checkpoints, losses],
    )
    trainer.fit(tiny_gpt(), repeated_batches(), ckpt_path=resume_from)
    return losses.losses


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("save_format", SAVE_FORMATS)
def test_saved_at_two_ranks_resumes_at_one_and_two_with_identical_next_losses(tmp_path, save_format):
    saved = run_function(
        train_with_checkpoints,
        2,
        args=(str(tmp_path / "saved"), SAVE_FORMATS[save_format], 4),
        init_process_group=False,
    )[0]
    checkpoint = tmp_path / "saved" / "checkpoints" / "step=2.ckpt"
    assert checkpoint.is_dir() if save_format == "sharded-async" else checkpoint.is_file()
    assert not list((tmp_path / "saved" / "checkpoints").glob("*.partial"))

    resume = dict(checkpoint_format=SAVE_FORMATS[save_format]["checkpoint_format"])
    for world_size in (2, 1):
        resumed = run_function(
            train_with_checkpoints,
            world_size,
            args=(str(tmp_path / f"resumed{world_size}"), resume, 4, str(checkpoint)),
            init_process_group=False,
        )[0]
        # Steps 3 and 4: the restored weights, and the restored AdamW moments and warm-up schedule.
        assert resumed == pytest.approx(saved[2:], rel=1e-6), f"resumed at {world_size} rank(s)"


def test_a_failed_write_over_an_existing_checkpoint_leaves_it_intact(tmp_path):
    target = tmp_path / "last.ckpt"
    save_file_atomically(lambda staged: staged.write_text("first"), target)

    def write_half_then_fail(staged: Path) -> None:
        staged.write_text("half of the sec")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_file_atomically(write_half_then_fail, target)
    assert target.read_text() == "first"
    save_file_atomically(lambda staged: staged.write_text("second"), target)
    assert target.read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no staging or replaced leftovers


def test_publishing_a_folder_replaces_a_previous_file_or_folder(tmp_path):
    target = tmp_path / "step.ckpt"
    target.write_text("a full checkpoint file")
    staged = staging_path(target)
    staged.mkdir()
    (staged / "shard").write_text("new")
    publish(staged, target)
    assert (target / "shard").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.ckpt"]
