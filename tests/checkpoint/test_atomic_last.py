"""``last.ckpt`` always names a complete checkpoint: a process SIGKILLed while replacing it leaves the previous one.

ModelCheckpoint(save_last=True) rewrites ``last.ckpt`` at every save. Both
strategies write it under ``last.ckpt.partial`` and publish it with one atomic
rename (a file) or exchange (a sharded folder). The tests kill rank 0 right
after the third ``last.ckpt`` has been written but before it is published (the
worst moment), then check that ``last.ckpt`` still holds step 2 and that a run
resumes from it with ``ckpt_path="last"``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist.parallel.checkpoint.atomic import SHARD_INDEX, publish, staging_path
from tests.support.harness import DistributedRunError, run_function
from tests.support.workloads import LossRecorder, make_trainer, repeated_batches, tiny_gpt

KILL_ON_LAST_SAVE = 3


def kill_when_last_is_written(kind: str) -> None:
    """Wrap the real writer: after the ``KILL_ON_LAST_SAVE``-th ``last.ckpt`` is written, SIGKILL this process."""
    if kind == "ddp":  # the file is torch.save's, straight into the staging file (what TorchCheckpointIO writes)
        import torch as writer_class

        method, target = "save", lambda args: Path(str(getattr(args[1], "name", args[1])))
    else:
        from torch.distributed.checkpoint import FileSystemWriter as writer_class

        method, target = "write_data", lambda args: Path(args[0].path)
    original, written = getattr(writer_class, method), []

    def write_then_die(*args, **kwargs):
        result = original(*args, **kwargs)
        if target(args).name == "last.ckpt" + ".partial":
            written.append(1)
            if len(written) == KILL_ON_LAST_SAVE and os.environ["RANK"] == "0":
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(writer_class, method, write_then_die)


def train(kind: str, folder: str, max_steps: int, kill: bool, resume: bool) -> list[float]:
    from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy

    if kill:
        kill_when_last_is_written(kind)
    strategy = (
        FastDDPStrategy(timeout=60) if kind == "ddp" else FastFSDPStrategy(checkpoint_format="sharded", timeout=60)
    )
    checkpoints = ModelCheckpoint(folder, "{step}", every_n_train_steps=1, save_last=True)
    losses = LossRecorder()
    trainer = make_trainer(strategy, max_steps=max_steps, enable_checkpointing=True, callbacks=[checkpoints, losses])
    trainer.fit(tiny_gpt(), repeated_batches(), ckpt_path="last" if resume else None)
    return losses.losses


def saved_step(kind: str, last: Path) -> int:
    if kind == "ddp":
        return torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    dcp.FileSystemReader(last).read_metadata()  # the tensor shards' index is complete
    return torch.load(last / _METADATA_FILENAME, weights_only=False)["global_step"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_kill_while_replacing_last_leaves_the_previous_last_loadable(tmp_path, kind):
    folder = tmp_path / "checkpoints"
    with pytest.raises(DistributedRunError, match="exit code -9"):
        run_function(train, 2, args=(kind, str(folder), 5, True, False), init_process_group=False, timeout=180)
    last = folder / "last.ckpt"
    assert staging_path(last).exists()  # the third last.ckpt was written, never published
    assert saved_step(kind, last) == KILL_ON_LAST_SAVE - 1

    resumed = run_function(
        train, 2, args=(kind, str(folder), KILL_ON_LAST_SAVE, False, True), init_process_group=False, timeout=180
    )
    assert len(resumed[0]) == 1  # resumed at step 2 from last.ckpt, trained step 3 only
    assert saved_step(kind, last) == KILL_ON_LAST_SAVE
    assert not staging_path(last).exists()


def test_publishing_a_checkpoint_folder_over_a_checkpoint_folder_swaps_them_in_one_step(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "__0_0.distcp").write_text("old")
    (target / SHARD_INDEX).write_text("old index")
    staged = staging_path(target)
    staged.mkdir()
    (staged / "__0_0.distcp").write_text("new")
    (staged / SHARD_INDEX).write_text("new index")
    old_inode = target.stat().st_ino
    publish(staged, target)
    assert (target / "__0_0.distcp").read_text() == "new"
    assert target.stat().st_ino != old_inode  # the folder was exchanged, not refilled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no .partial, no .replaced left
