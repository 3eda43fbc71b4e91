"""PowerSGD in checkpoints: each rank's error feedback in its own file beside the checkpoint, never gathered, in the
folder of its save, so that a later save that dies half-way never touches the files of the checkpoint published.

The file functions need no collective, so the fast tests play both ranks in one process; the slow one
trains two real gloo ranks with FastDDPStrategy and Lightning's ModelCheckpoint.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdist import FastDDPStrategy
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.parallel.checkpoint.side_saves import POWERSGD_ERRORS
from lightning_fastdist.parallel.ddp.powersgd import PowerSGDSettings, PowerSGDState
from lightning_fastdist.strategies.ddp.comm_hook_checkpoint import (
    CHECKPOINT_KEY,
    remember_location,
    remove_shards,
    restore_hook_state,
    save_hook_state,
)
from tests.support.fault_runs import write_corpus
from tests.support.harness import run_function

WORLD = 2


def rank_state(rank: int, iteration: int = 7) -> PowerSGDState:
    state = PowerSGDState(settings=PowerSGDSettings())
    state.iteration = iteration
    state.errors = {0: torch.full((3, 2), float(rank)), 4: torch.full((5,), float(rank) + 0.5)}
    state.q_memory = {0: torch.ones(2, 2), 4: torch.arange(4.0).view(2, 2)}  # the same on every rank
    return state


def save_rank(path: Path, world: int, rank: int, iteration: int, step: int) -> dict:
    """What ``rank`` puts in the checkpoint, once its part of the save (its file) is written."""
    shared, part = save_hook_state(rank_state(rank, iteration), "powersgd", path, world, rank, step)
    part.write(part.state)
    return shared


def save_all(path: Path, world: int = WORLD, iteration: int = 7, step: int = 7) -> dict:
    saved = [save_rank(path, world, r, iteration, step) for r in range(world)]
    return remember_location(saved[0], path)  # what rank 0 puts in the checkpoint, as loaded back


def save_folder(path: Path, step: int = 7) -> Path:
    return Path(POWERSGD_ERRORS.save_folder(path, step))


def restored(saved: dict, world: int, rank: int) -> PowerSGDState:
    state = PowerSGDState(settings=PowerSGDSettings())
    restore_hook_state(state, "powersgd", saved, world, rank, torch.device("cpu"))
    return state


def test_each_rank_writes_its_own_file_and_gets_it_back(tmp_path):
    saved = save_all(tmp_path / "last.ckpt")
    assert "errors" not in saved and "per_rank" not in saved  # nothing of any rank's error feedback in the checkpoint
    assert sorted(p.name for p in save_folder(tmp_path / "last.ckpt").iterdir()) == ["rank00000.pt", "rank00001.pt"]
    for rank in range(WORLD):
        state = restored(saved, WORLD, rank)
        assert state.iteration == 7 and torch.equal(state.q_memory[4], torch.arange(4.0).view(2, 2))
        assert torch.equal(state.errors[0], torch.full((3, 2), float(rank)))  # its own, not rank 0's


def test_another_world_size_restarts_error_feedback_with_one_line_and_reads_no_file(tmp_path):
    saved = save_all(tmp_path / "last.ckpt")
    for file in save_folder(tmp_path / "last.ckpt").iterdir():
        file.write_bytes(b"not read")  # a resume at another world size never opens them
    with pytest.warns(UserWarning, match="saved by 2 ranks and is resumed by 1: keeping the step count and Q"):
        state = restored(saved, 1, 0)
    assert state.errors == {} and state.iteration == 7 and set(state.q_memory) == {0, 4}


def test_a_later_save_that_died_leaves_the_published_files_and_a_missing_one_restarts_that_rank(tmp_path):
    path = tmp_path / "last.ckpt"
    saved = save_all(path, iteration=7, step=7)
    save_rank(path, WORLD, 1, iteration=9, step=9)  # a later save died after rank 1's file
    assert torch.equal(restored(saved, WORLD, 1).errors[0], torch.ones(3, 2))  # the published save's own file
    assert torch.equal(restored(saved, WORLD, 0).errors[0], torch.zeros(3, 2))
    (save_folder(path) / "rank00000.pt").unlink()
    with pytest.warns(UserWarning, match=r"\[rank 0\] .* cannot be read"):
        assert restored(saved, WORLD, 0).errors == {}


def test_only_our_files_are_removed(tmp_path):
    path = tmp_path / "epoch=0-step=4.ckpt"
    save_all(path, world=4)
    folder = save_folder(path)
    (folder / "notes.txt").write_text("a user's file")
    remove_shards(path)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]  # the folder stays while it holds anything else
    (folder / "notes.txt").unlink()
    save_all(path)
    remove_shards(path)
    assert not Path(POWERSGD_ERRORS.root(path)).exists()


def train_and_keep_one_checkpoint(corpus: str, folder: str) -> dict:
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=1, monitor="step", mode="max")
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[checkpoints],
        strategy=FastDDPStrategy(comm_hook="powersgd", powersgd_rank=4, powersgd_start_iter=2, timeout=120),
    )  # fmt: skip
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=16)
    trainer.fit(model, TextDataModule(batch_size=2, block_size=16, corpus_path=corpus, val_fraction=0.1))
    state = trainer.strategy.hook_state
    return {"iteration": state.iteration, "errors": {k: v.clone() for k, v in state.errors.items()}}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fast_ddp_writes_each_ranks_file_beside_its_checkpoint_and_removes_them_with_it(tmp_path):
    corpus = str(write_corpus(tmp_path / "corpus.bin", 8, WORLD))
    folder = tmp_path / "checkpoints"
    results = run_function(train_and_keep_one_checkpoint, WORLD, args=(corpus, str(folder)), init_process_group=False)
    (kept,) = sorted(folder.glob("*.ckpt"))  # top-1: the earlier checkpoints and their files were removed
    assert sorted(p.name for p in folder.iterdir()) == [kept.name, kept.name + ".powersgd"]
    saved = torch.load(kept, weights_only=True)[CHECKPOINT_KEY]
    assert saved["world_size"] == WORLD and "per_rank" not in saved and saved["iteration"] == 6
    for rank, result in enumerate(results):
        shard = torch.load(save_folder(kept, 6) / f"rank{rank:05d}.pt", weights_only=True)
        assert shard["iteration"] == result["iteration"] == 6 and shard["rank"] == rank
        assert shard["errors"].keys() == result["errors"].keys() and result["errors"]
        assert all(torch.equal(shard["errors"][key], result["errors"][key]) for key in shard["errors"])
    assert not torch.equal(*(results[r]["errors"][min(results[0]["errors"])] for r in range(WORLD)))  # per rank
