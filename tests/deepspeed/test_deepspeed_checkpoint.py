"""Publishing a DeepSpeed checkpoint folder atomically, on real files (one process: no DeepSpeed needed).

DeepSpeed writes a folder holding ``latest`` (the name of the tag folder), its conversion scripts and
a tag folder of per-rank states. ``save_folder_atomically`` has it written under ``<name>.partial``
and publishes it whole; a folder that is not a checkpoint keeps everything of its owner.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fastdist.parallel.checkpoint.atomic import save_folder_atomically
from lightning_fastdist.parallel.checkpoint.checkpoint_files import STAGING_SUFFIX


def write_deepspeed_folder(folder: Path, step: int, ranks: int = 2) -> None:
    """What ``DeepSpeedEngine.save_checkpoint(folder, tag="checkpoint")`` leaves, with the step in every file."""
    tag = folder / "checkpoint"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    (folder / "zero_to_fp32.py").write_text(f"# script {step}")
    (tag / "mp_rank_00_model_states.pt").write_text(f"model {step}")
    for rank in range(ranks):
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text(f"optimizer {step}")


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_save_replaces_an_earlier_deepspeed_checkpoint_whole(tmp_path):
    target = tmp_path / "last.ckpt"
    save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 1, ranks=4), target)
    save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 2, ranks=2), target)
    files = tree(target)
    assert files["checkpoint/mp_rank_00_model_states.pt"] == "model 2"
    assert "checkpoint/zero_pp_rank_3_mp_rank_00_optim_states.pt" not in files  # nothing of the first save is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 1), target)
    before = tree(target)

    def crash(staged: Path) -> None:
        write_deepspeed_folder(staged, 2)
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError, match="killed"):
        save_folder_atomically(crash, target)
    assert tree(target) == before
    save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 3), target)  # the stale .partial goes first
    assert tree(target)["checkpoint/mp_rank_00_model_states.pt"] == "model 3"
    assert not (tmp_path / f"last.ckpt{STAGING_SUFFIX}").exists()


def test_a_save_into_a_users_folder_keeps_the_users_files(tmp_path):
    folder = tmp_path / "runs"
    (folder / "mine").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "mine" / "data.txt").write_text("mine too")
    save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 1, ranks=4), folder)
    save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 2), folder)
    files = tree(folder)
    assert files["notes.txt"] == "mine" and files["mine/data.txt"] == "mine too"
    assert files["latest"] == "checkpoint" and files["checkpoint/mp_rank_00_model_states.pt"] == "model 2"
    assert "checkpoint/zero_pp_rank_3_mp_rank_00_optim_states.pt" not in files


def test_a_users_folder_in_the_way_of_the_tag_folder_is_never_replaced(tmp_path):
    folder = tmp_path / "runs"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not part of a checkpoint and is never replaced"):
        save_folder_atomically(lambda staged: write_deepspeed_folder(staged, 1), folder)
    assert tree(folder) == {"checkpoint/notes.txt": "mine"}
