"""What a fault on the publish path can no longer destroy (issue 56, items 6-9), on real files and tiny fits in this
process: a save onto a link, a publish without ``RENAME_EXCHANGE`` cut between its two renames, what failed saves
leave, a full disk, and a second run saving into the same folder.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist.parallel.checkpoint import atomic
from lightning_fastdist.parallel.checkpoint.atomic import publish, save_file_atomically, save_folder_atomically
from lightning_fastdist.parallel.checkpoint.checkpoint_files import (
    LIGHTNING_METADATA,
    SHARD_INDEX,
    replaced_path,
    staging_path,
)
from lightning_fastdist.parallel.checkpoint.folder_lock import hold_folder, lock_file
from lightning_fastdist.parallel.checkpoint.save_failure import CheckpointSaveError
from lightning_fastdist.parallel.checkpoint.side_saves import OUTER_SYNC_NODES
from lightning_fastdist.strategies.checkpoint.saves import CheckpointSaves
from tests.support.harness import run_function
from tests.support.workloads import make_trainer, repeated_batches, tiny_gpt

DOCS = Path(__file__).resolve().parents[2] / "docs"


def sharded_save(target: Path, tag: str) -> Path:
    """A finished sharded save of ``target``, as the writer leaves it before publishing."""
    staged = staging_path(target)
    staged.mkdir()
    (staged / "__0_0.distcp").write_text(f"{tag} shard")
    (staged / LIGHTNING_METADATA).write_text(f"{tag} meta")
    (staged / SHARD_INDEX).write_text(f"{tag} index")
    return staged


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def no_rename_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without ``RENAME_EXCHANGE`` (NFS): the exchange reports it unsupported, as renameat2 does."""
    monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)


class Killed(BaseException):
    """The process died at that instant (nothing after it runs)."""


def killed_moving_in(monkeypatch: pytest.MonkeyPatch, staged_name: str, on_call: int) -> None:
    """The process dies as it renames ``staged_name`` into place the ``on_call``-th time."""
    real_replace, calls = os.replace, []

    def replace(source, target) -> None:
        if Path(source).name == staged_name:
            calls.append(target)
            if len(calls) == on_call:
                raise Killed
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)


# ---------------------------------------------------------------- item 6: a save onto a link


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_a_sharded_save_onto_a_link_replaces_the_link_and_never_writes_into_what_it_names(
    tmp_path, monkeypatch, exchange
):
    if not exchange:
        no_rename_exchange(monkeypatch)
    best = tmp_path / "step=2.ckpt"
    publish(sharded_save(best, "step 2"), best)
    last = tmp_path / "last.ckpt"
    last.symlink_to(best.name)  # what ModelCheckpoint(save_last="link") leaves
    publish(sharded_save(last, "step 3"), last)
    assert tree(best) == {
        SHARD_INDEX: "step 2 index",
        "__0_0.distcp": "step 2 shard",
        LIGHTNING_METADATA: "step 2 meta",
    }
    assert not last.is_symlink() and tree(last)[SHARD_INDEX] == "step 3 index"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"]


# ---------------------------------------------------------------- item 8: no RENAME_EXCHANGE, and durability


def test_without_rename_exchange_a_kill_between_the_two_renames_leaves_a_copy_that_last_finds(tmp_path, monkeypatch):
    no_rename_exchange(monkeypatch)
    last = tmp_path / "last.ckpt"
    publish(sharded_save(last, "step 2"), last)
    killed_moving_in(monkeypatch, staging_path(last).name, on_call=1)
    with pytest.raises(Killed):
        publish(sharded_save(last, "step 3"), last)
    assert not last.exists()  # between the renames
    assert tree(replaced_path(last))[SHARD_INDEX] == "step 2 index"  # the previous copy, complete
    found = ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer=None)
    assert found == {str(replaced_path(last))}  # what ckpt_path="last" resumes from


def fit_sharded(folder: Path, max_steps: int, resume: bool) -> tuple[int, int]:
    """An FSDP fit of one process with a sharded ``last.ckpt`` every step; its final step and the batches it trained."""
    from lightning_fastdist import FastFSDPStrategy
    from tests.support.workloads import LossRecorder

    losses = LossRecorder()
    checkpoints = ModelCheckpoint(folder, every_n_train_steps=1, save_last=True, save_top_k=0)
    strategy = FastFSDPStrategy(checkpoint_format="sharded")
    trainer = make_trainer(
        strategy, devices=1, max_steps=max_steps, enable_checkpointing=True, callbacks=[checkpoints, losses]
    )
    trainer.fit(tiny_gpt(), repeated_batches(), ckpt_path="last" if resume else None)
    return trainer.global_step, len(losses.losses)


def test_a_fit_killed_between_the_two_renames_resumes_with_ckpt_path_last_from_the_copy_kept(tmp_path, monkeypatch):
    """The first ``last`` is renamed in (nothing to replace), each later one in two renames: the third dies between."""
    no_rename_exchange(monkeypatch)
    folder = tmp_path / "checkpoints"
    with monkeypatch.context() as killing:
        killed_moving_in(killing, "last.ckpt.partial", on_call=3)
        with pytest.raises(Killed):
            fit_sharded(folder, max_steps=5, resume=False)
    assert not (folder / "last.ckpt").exists() and (folder / "last.replaced.ckpt").is_dir()
    assert fit_sharded(folder, max_steps=3, resume=True) == (3, 1)  # resumed at step 2, trained step 3
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]  # the copy kept, and the killed save, are gone


def write_deepspeed_folder(folder: Path) -> None:
    """What DeepSpeed's engine leaves (``latest``, a tag folder of states), which it never syncs."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    (folder / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"PK" * 1000)


def traced_saves(target: Path, trace: Path) -> list[str]:
    """Two saves of ``target`` (the second exchanges the folders) by a forked child of this process, its file system
    calls recorded by strace: ``call(...) = result`` lines."""
    go = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - traced
        try:
            os.read(go[0], 1)
            for _ in range(2):
                save_folder_atomically(write_deepspeed_folder, target)
        finally:
            os._exit(0)
    command = ["strace", "-f", "-y", "-e", "trace=fsync,rename,renameat2", "-o", str(trace), "-p", str(child)]
    tracer = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert "attached" in tracer.stderr.readline()
    os.write(go[1], b"x")
    os.waitpid(child, 0)
    tracer.wait(timeout=60)
    return [line.split(None, 1)[1] for line in trace.read_text().splitlines() if "(" in line]


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_published_folder_is_durable_its_files_and_folder_synced_before_the_rename_and_its_parent_after(tmp_path):
    """DeepSpeed's folders were published with nothing synced, and no publish synced the folder holding the rename:
    after a power cut the new name could point at a folder whose files never reached the disk."""
    target = tmp_path / "last.ckpt"
    calls = traced_saves(target, tmp_path / "trace.txt")
    exchange = next(i for i, call in enumerate(calls) if call.startswith("renameat2(") and "RENAME_EXCHANGE" in call)
    synced_before = [call for call in calls[:exchange] if call.startswith("fsync(")]
    staged = staging_path(target)
    for path in (
        staged / "latest",
        staged / "checkpoint" / "mp_rank_00_model_states.pt",
        staged / "checkpoint",
        staged,
    ):
        assert any(f"<{path}>" in call for call in synced_before), f"{path} not synced before the rename"
    assert any(call.startswith("fsync(") and f"<{tmp_path}>" in call for call in calls[exchange:])


# ---------------------------------------------------------------- item 7: leftovers, a full disk


def fit_ddp(folder: Path, max_steps: int = 1) -> int:
    """A DDP fit of one process that saves ``step=N.ckpt`` and ``last.ckpt`` in ``folder`` at its last step."""
    from lightning_fastdist import FastDDPStrategy

    checkpoints = ModelCheckpoint(folder, "{step}", every_n_train_steps=max_steps, save_last=True)
    trainer = make_trainer(
        FastDDPStrategy(), devices=1, max_steps=max_steps, enable_checkpointing=True, callbacks=[checkpoints]
    )
    trainer.fit(tiny_gpt(), repeated_batches())
    return trainer.global_step


def test_what_failed_saves_left_goes_at_the_next_runs_first_save_and_nothing_else_does(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"cut": "short"}, folder / "step=5.ckpt.partial")  # a file save killed before its rename
    sharded_save(folder / "step=6.ckpt", "killed")  # a sharded one: step=6.ckpt.partial/
    torch.save({"global_step": 4}, folder / "last.ckpt")
    torch.save({"global_step": 3}, replaced_path(folder / "last.ckpt"))  # set aside, its checkpoint back since
    torch.save({"global_step": 2}, folder / "old.replaced.ckpt")  # set aside, its checkpoint missing: the only copy
    orphan = Path(OUTER_SYNC_NODES.save_folder(folder / "step=4.ckpt", 4))  # a node's file; its checkpoint never came
    orphan.mkdir(parents=True)
    torch.save({"node": 0}, orphan / "node00000.pt")
    (folder / "notes.partial").write_text("the user's own")  # not a save of ours
    assert fit_ddp(folder, max_steps=5) == 5  # its first save, at step 5, removes them
    names = {p.name for p in folder.iterdir()}
    assert not names & {"step=5.ckpt.partial", "step=6.ckpt.partial", "last.replaced.ckpt", "step=4.ckpt.outer_sync"}
    assert {"notes.partial", "old.replaced.ckpt", "step=5.ckpt"} <= names
    assert (folder / "notes.partial").read_text() == "the user's own"


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 1 MiB file system of its own (tmpfs; needs root, as CI is)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_one_line_naming_the_path_and_the_bytes_needed_and_frees_what_it_wrote(small_disk):
    target = small_disk / "model.ckpt"
    save_file_atomically(lambda staged: staged.write_bytes(b"PK" * 50_000), target)
    with pytest.raises(CheckpointSaveError) as full:
        save_file_atomically(lambda staged: staged.write_bytes(b"PK" * 1_000_000), target, expected_bytes=2_000_000)
    line = str(full.value)
    assert "\n" not in line and f"cannot save checkpoint '{target}': the disk holding it is full" in line
    assert "the save needs about 2,000,000 bytes and " in line and " bytes are free there." in line
    documented = (DOCS / "bad-inputs.md").read_text()
    assert (
        "`checkpoint-disk-full`" in documented and "the disk holding it is full (No space left on device)" in documented
    )
    assert target.read_bytes() == b"PK" * 50_000  # the previous checkpoint
    assert sorted(p.name for p in small_disk.iterdir()) == ["model.ckpt"]  # the partial save removed
    assert shutil.disk_usage(small_disk).free > 800_000


def test_torch_saves_cut_short_by_a_full_disk_are_the_same_one_line(small_disk):
    # torch.save reports the write the full disk cut short as its zip writer's RuntimeError ("unexpected pos"), not
    # as the OSError: still a full disk (found by the fault campaign).
    target = small_disk / "model.ckpt"
    try:
        save_file_atomically(lambda staged: torch.save({"weight": torch.zeros(600_000)}, staged), target)
    except CheckpointSaveError as full:
        line, cause = str(full), type(full.__cause__)  # not kept: its traceback holds torch's open file
    assert "the disk holding it is full" in line and cause is RuntimeError and not list(small_disk.iterdir())
    gc.collect()  # torch's file object, left to the collector by its own error, before the disk is unmounted


def save_onto_a_full_disk(disk: str) -> str:
    """Rank 0 writes a checkpoint larger than the disk; every rank's outcome (the way FastDDPStrategy saves)."""
    strategy = SimpleNamespace(checkpoint_io=TorchCheckpointIO(), lightning_module=None)
    saves = CheckpointSaves(strategy, asynchronous=False)
    try:
        saves.one_file(
            {"state_dict": {"weight": torch.zeros(600_000)}}, Path(disk) / "last.ckpt", dist.get_rank() == 0, []
        )
    except CheckpointSaveError as error:
        return str(error)
    return "saved"


@pytest.mark.multiprocess
def test_a_full_disk_on_the_writing_rank_ends_the_save_on_every_rank_at_once(small_disk):
    rank0, rank1 = run_function(save_onto_a_full_disk, 2, args=(str(small_disk),), timeout=60)
    assert rank0.startswith(f"cannot save checkpoint '{small_disk / 'last.ckpt'}': the disk holding it is full")
    assert "needs about 2,400,000 bytes" in rank0
    assert rank1 == f"{rank0} (on rank 0)"  # not left waiting at a barrier until the collective timeout
    assert not list(small_disk.iterdir())


# ---------------------------------------------------------------- item 9: one run per folder


@pytest.fixture
def held_by_another_run(tmp_path) -> Iterator[Path]:
    """``tmp_path / "checkpoints"`` held by another live process, as a run saving there holds it."""
    folder = tmp_path / "checkpoints"
    ready, release = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the other run
        try:
            hold_folder(folder, 0)
            os.write(ready[1], b"held")
            os.read(release[0], 1)
        finally:
            os._exit(0)
    assert os.read(ready[0], 4) == b"held"
    try:
        yield folder
    finally:
        os.write(release[1], b"x")
        os.waitpid(child, 0)


def test_a_second_run_saving_into_a_folder_another_live_run_writes_is_refused_in_one_line(held_by_another_run):
    folder = held_by_another_run
    with pytest.raises(CheckpointSaveError) as refused:
        fit_ddp(folder)
    line = str(refused.value)
    assert "\n" not in line and f"checkpoint folder '{folder}' is being written by another run (pid " in line
    assert "two runs saving there would replace each other's checkpoints" in line
    assert "`checkpoint-folder-in-use`" in (DOCS / "bad-inputs.md").read_text()
    assert [p.name for p in folder.iterdir()] == [lock_file(folder, 0).name]  # nothing of this run written


def test_a_folder_is_free_again_once_the_run_that_wrote_it_ended(tmp_path):
    folder = tmp_path / "checkpoints"
    assert fit_ddp(folder) == 1
    assert not lock_file(folder, 0).exists()  # released (and removed) at the fit's end
    assert fit_ddp(folder, max_steps=2) == 2
