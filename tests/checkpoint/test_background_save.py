"""The one background-save mechanism every engine's save ends with (``async_checkpointing``), in one process on real
files: training goes on while a copy is written, the checkpoint is published only once complete (the previous one
whole until then), at most one save is in flight (a save of the same values shares its copy), and removing the
checkpoint a save replaces waits for its publish and is dropped when it fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from lightning_fastdist.parallel.checkpoint.atomic import file_part
from lightning_fastdist.parallel.checkpoint.background_save import BackgroundSave
from lightning_fastdist.parallel.checkpoint.checkpoint_files import staging_path

WAIT_S = 60  # only ever reached when a test fails: nothing here waits on time


class GatedWrites:
    """``torch.save`` that waits for :meth:`release` before writing, and counts the writes begun."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.begun = 0

    def release(self) -> None:
        self.released.set()

    def __call__(self, state: object, staged: Path) -> None:
        self.begun += 1
        assert self.released.wait(WAIT_S), "never released"
        torch.save(state, staged)


def save(saves: BackgroundSave, state: dict, path: Path, write, in_background: bool = True) -> None:
    part, publication = file_part(state, path, write, step=state["step"])
    saves.save(path, [part], publication, in_background)


@pytest.fixture
def saves() -> BackgroundSave:
    background = BackgroundSave()
    background.go_background(None)  # one process: nothing to agree with
    return background


def test_training_goes_on_while_the_copy_is_written_and_the_previous_checkpoint_stays_until_it_is_complete(
    saves, tmp_path
):
    path = tmp_path / "last.ckpt"
    torch.save({"step": 1}, path)
    weights = torch.zeros(1000)
    writes = GatedWrites()
    save(saves, {"step": 2, "weights": weights}, path, writes)

    weights += 1  # the next optimizer step, while the save is being written
    assert torch.load(path)["step"] == 1  # the previous checkpoint is the resumable one until the new one is complete
    writes.release()
    saves.wait()
    saved = torch.load(path)
    assert saved["step"] == 2 and torch.equal(saved["weights"], torch.zeros(1000))  # the values at the save
    assert not staging_path(path).exists()


def test_a_save_of_other_values_waits_for_the_one_in_flight_and_reuses_its_memory(saves, tmp_path):
    weights = torch.zeros(1000)
    first = GatedWrites()
    save(saves, {"step": 2, "weights": weights}, tmp_path / "a.ckpt", first)
    weights += 1
    second_started = threading.Event()

    def second_save() -> None:
        save(saves, {"step": 3, "weights": weights}, tmp_path / "b.ckpt", torch.save)
        second_started.set()

    caller = threading.Thread(target=second_save)
    caller.start()
    assert not second_started.wait(0.5)  # its copy would overwrite what the first save is writing
    first.release()
    caller.join(WAIT_S)
    saves.wait()
    assert torch.equal(torch.load(tmp_path / "a.ckpt")["weights"], torch.zeros(1000))
    assert torch.equal(torch.load(tmp_path / "b.ckpt")["weights"], torch.ones(1000))
    assert saves.copies == 2


def test_a_save_of_the_same_values_shares_the_copy_and_is_written_after_the_first(saves, tmp_path):
    weights = torch.arange(1000.0)
    writes = GatedWrites()
    save(saves, {"step": 4, "weights": weights}, tmp_path / "step=4.ckpt", writes)
    save(saves, {"step": 4, "weights": weights}, tmp_path / "last.ckpt", writes)  # save_last beside top-k: no wait
    assert saves.copies == 1  # returned while the first is held: queued behind it, on the same copy
    writes.release()
    saves.wait()
    for name in ("step=4.ckpt", "last.ckpt"):
        assert torch.equal(torch.load(tmp_path / name)["weights"], weights)


def test_removing_the_replaced_checkpoint_waits_for_the_publish(saves, tmp_path):
    old = tmp_path / "step=1.ckpt"
    torch.save({"step": 1}, old)
    writes = GatedWrites()
    save(saves, {"step": 2}, tmp_path / "step=2.ckpt", writes)
    saves.after_published(old.unlink)  # ModelCheckpoint's top-k removing the checkpoint the new one replaces
    assert old.exists()
    writes.release()
    saves.wait()
    assert not old.exists() and (tmp_path / "step=2.ckpt").exists()
    saves.after_published(lambda: (tmp_path / "step=2.ckpt").unlink())  # nothing in flight: at once
    assert not (tmp_path / "step=2.ckpt").exists()


def test_a_failed_background_write_is_raised_by_the_next_wait_and_keeps_the_checkpoint_it_would_replace(
    saves, tmp_path
):
    old = tmp_path / "step=1.ckpt"
    torch.save({"step": 1}, old)

    def disk_error(state: object, staged: Path) -> None:
        staged.write_bytes(b"PK half a checkpoint")
        raise OSError("Input/output error")

    save(saves, {"step": 2}, tmp_path / "step=2.ckpt", disk_error)
    saves.after_published(old.unlink)
    with pytest.raises(OSError, match="Input/output error"):
        saves.wait()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step=1.ckpt"]  # no partial, the old one kept
    saves.wait()  # raised once


def test_a_save_outside_the_background_is_complete_when_it_returns(saves, tmp_path):
    writes = GatedWrites()
    save(saves, {"step": 5}, tmp_path / "a.ckpt", writes)
    writes.release()
    save(saves, {"step": 6}, tmp_path / "b.ckpt", torch.save, in_background=False)  # a stop: the save in flight first
    assert torch.load(tmp_path / "a.ckpt")["step"] == 5 and torch.load(tmp_path / "b.ckpt")["step"] == 6
    assert saves.copies == 1  # written from the live state, as without async_checkpointing
