"""A checkpoint saved where the LightningModule is attached to no trainer, as Lightning's strategies save it.

Lightning attaches the module to its trainer inside the ranks only: after a fit whose ranks were started with
``start_method="spawn"`` or ``"fork"``, ``trainer.save_checkpoint`` runs in the main process with a module that has no
trainer, and a strategy's own ``save_checkpoint`` may be called on a module given to it directly. Both wrote a file
under Lightning's ``DDPStrategy`` and failed under ours (``BoringModel is not attached to a `Trainer```), issue 57.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from tests.support.harness import run_function


@pytest.mark.parametrize(
    "strategy",
    [FastDDPStrategy, lambda: FastFSDPStrategy(checkpoint_format="full")],
    ids=["fast_ddp", "fast_fsdp_full"],
)
def test_a_strategy_saves_a_module_given_to_it_directly(tmp_path, strategy):
    strategy = strategy()
    model = BoringModel()
    strategy.connect(model)
    strategy.save_checkpoint({"state_dict": model.state_dict()}, tmp_path / "direct.ckpt")
    saved = torch.load(tmp_path / "direct.ckpt", weights_only=True)
    assert saved.keys() == {"state_dict"}  # nothing of ours: no fit, no rank's state
    assert all(torch.equal(saved["state_dict"][name], value) for name, value in model.state_dict().items())


def _fit_forked_then_save(folder: str) -> dict:
    """In a fresh process of its own (a process group an earlier test left in this one would reach the forked ranks):
    a fit whose ranks Lightning forks, then ``trainer.save_checkpoint`` in this, the main process."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # the harness's: this process is a main process, not a rank of a job
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FastDDPStrategy(start_method="fork"), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    model = BoringModel()
    trainer.fit(model)
    trainer.save_checkpoint(Path(folder) / "after_fork.ckpt")
    saved = torch.load(Path(folder) / "after_fork.ckpt", weights_only=False)
    return {"keys": sorted(saved), "weights": saved["state_dict"], "model": model.state_dict()}


@pytest.mark.multiprocess
def test_trainer_save_checkpoint_in_the_main_process_after_a_forked_fit(tmp_path):
    """``start_method="fork"`` and ``"spawn"`` leave the main process alike (Lightning's multiprocessing launcher
    attaches the module in the ranks only); fork starts faster."""
    (saved,) = run_function(_fit_forked_then_save, 1, args=(str(tmp_path),), init_process_group=False)
    # The ranks' trained weights, which Lightning's launcher gave the main process's module (the main process's loops
    # never ran: its global step is 0, as under Lightning's DDPStrategy).
    assert saved["weights"].keys() == saved["model"].keys()
    assert all(torch.equal(saved["weights"][name], value) for name, value in saved["model"].items())
    assert not any(key.startswith("fastdist_") for key in saved["keys"])  # no rank's random states in this process
