"""The way back to Lightning's strategies, in one process: what is not our checkpoint is one line (exit status 2 from
the command), an optimizer's state keyed by name is numbered as torch numbers it, and a file already in Lightning's form
is written as it is. Every engine's checkpoint converted and resumed by Lightning's ``DDPStrategy`` and
``ModelParallelStrategy`` against the run not interrupted: a cell of ``tests/contract/test_contract_part_five.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdist import to_lightning_checkpoint
from lightning_fastdist.commands import to_lightning
from lightning_fastdist.strategies.fsdp.one_file import numbered_by_parameter


def test_what_is_not_our_checkpoint_is_one_line_and_exit_status_2(tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match=r"^to-lightning: '.*folder' is not a checkpoint of lightning_fastdist") as no:
        to_lightning_checkpoint(tmp_path / "folder", tmp_path / "out.ckpt")
    assert "\n" not in str(no.value) and not (tmp_path / "out.ckpt").exists()
    with pytest.raises(SystemExit) as exited:
        to_lightning.main([str(tmp_path / "folder"), str(tmp_path / "out.ckpt")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exited.value.code == 2 and len(errors) == 1 and "is not a checkpoint of lightning_fastdist" in errors[0]


def test_an_optimizer_state_by_name_is_numbered_in_the_order_of_its_groups():
    by_name = {
        "state": {"b.weight": {"momentum_buffer": torch.ones(1)}, "a.weight": {"momentum_buffer": torch.zeros(1)}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight"]}, {"lr": 0.05, "params": ["b.weight", "b.bias"]}],
    }
    numbered = numbered_by_parameter(by_name)
    assert numbered["param_groups"] == [{"lr": 0.1, "params": [0]}, {"lr": 0.05, "params": [1, 2]}]
    assert numbered["state"].keys() == {0, 1} and torch.equal(numbered["state"][1]["momentum_buffer"], torch.ones(1))


def test_a_file_in_lightnings_form_is_written_as_it_is(tmp_path, capsys):
    saved = {"state_dict": {"w": torch.arange(3.0)}, "loops": {"fit_loop": {}}, "global_step": 3}
    torch.save(saved, tmp_path / "ours.ckpt")
    assert to_lightning.main([str(tmp_path / "ours.ckpt"), str(tmp_path / "lightning.ckpt")]) == 0
    written = torch.load(tmp_path / "lightning.ckpt", weights_only=True)
    assert written.keys() == saved.keys() and torch.equal(written["state_dict"]["w"], saved["state_dict"]["w"])
    assert "resume it with Lightning's DDPStrategy or ModelParallelStrategy" in capsys.readouterr().out
