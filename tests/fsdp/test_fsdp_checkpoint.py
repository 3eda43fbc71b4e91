"""FastFSDPStrategy checkpoints on disk: save at 2 ranks, resume at 1 and 2; a save killed midway harms nothing."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist.parallel.checkpoint.atomic import publish, save_file_atomically, staging_path
from tests.support.harness import DistributedRunError, run_function
from tests.support.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt

SAVE_FORMATS = {
    # Sharded and written in the background by a model with activation checkpointing,
    # resumed without it: checkpoints do not depend on either.
    "sharded-async": dict(checkpoint_format="sharded", async_checkpointing=True, activation_checkpointing="full"),
    "full": dict(checkpoint_format="full"),
}


class WriteLosses(L.Callback):
    """Rank 0 appends each step's loss to a JSON-lines file, so that a killed run still leaves its losses."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps(float(outputs["loss"])) + "\n")


def _kill_this_process_on_save(number: int, checkpoint_format: str) -> None:
    """Patch the real writer so that save number ``number`` writes its data, then SIGKILLs this process."""
    if checkpoint_format == "sharded":
        from torch.distributed.checkpoint import FileSystemWriter as writer_class

        method = "write_data"
    else:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as writer_class

        method = "save_checkpoint"
    original, calls = getattr(writer_class, method), []

    def write_then_die(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == number:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(writer_class, method, write_then_die)


def train_with_checkpoints(
    folder: str, options: dict, max_steps: int, resume_from: str | None = None, kill_on_save: int | None = None
) -> list[float]:
    """Train on repeated batches, saving every step into ``folder``/checkpoints; return this rank's losses."""
    from lightning_fastdist import FastFSDPStrategy

    if kill_on_save is not None:
        _kill_this_process_on_save(kill_on_save, options.get("checkpoint_format", "sharded"))
    checkpoints = ModelCheckpoint(Path(folder, "checkpoints"), "{step}", every_n_train_steps=1, save_top_k=-1)
    losses = LossRecorder()
    trainer = make_trainer(
        FastFSDPStrategy(**options),
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[checkpoints, losses, WriteLosses(Path(folder, "losses.jsonl"))],
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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, checkpoint_format):
    options = dict(checkpoint_format=checkpoint_format)
    with pytest.raises(DistributedRunError, match="exit code -9"):
        run_function(
            train_with_checkpoints, 2, args=(str(tmp_path / "killed"), options, 3, None, 2), init_process_group=False
        )
    folder = tmp_path / "killed" / "checkpoints"
    assert (folder / "step=2.ckpt.partial").exists()  # the save was under way when the process died
    assert not (folder / "step=2.ckpt").exists()
    losses_before_kill = [json.loads(line) for line in (tmp_path / "killed" / "losses.jsonl").read_text().splitlines()]

    resumed = run_function(
        train_with_checkpoints, 1, args=(str(tmp_path / "resumed"), options, 2, str(folder / "step=1.ckpt")),
        init_process_group=False,
    )[0]  # fmt: skip
    assert resumed == pytest.approx(losses_before_kill[1:2], rel=1e-6)


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
