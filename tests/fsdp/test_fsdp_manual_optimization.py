"""Manual optimization under FastFSDPStrategy: DDP's gradients, or one line before any process starts.

Lightning's GAN pattern (``automatic_optimization = False``, two optimizers, ``toggle_optimizer``,
``manual_backward``, ``opt.step()``), generator and discriminator as two plain-torch ``nn.Sequential`` MLPs called
as ``self.D(self.G(z))``. The backward runs inside the step, where the root FSDP unit cannot reduce its gradients:
a model whose parameters the blocks leave in the root is refused, naming the blocks that fix it; with them, the
losses are Lightning's ``DDPStrategy``'s.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdist import FastFSDPStrategy
from tests.support.harness import run_function

WORLD, STEPS = 2, 3
EXACT = 1e-5


class GAN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.D = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.losses: list[tuple[float, float]] = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.G.parameters(), lr=0.1), torch.optim.SGD(self.D.parameters(), lr=0.1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], 8, generator=torch.Generator().manual_seed(batch_idx))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.D(self.G(z)), ones)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        fake = self.G(z).detach()
        d_loss = (
            F.binary_cross_entropy_with_logits(self.D(real), ones)
            + F.binary_cross_entropy_with_logits(self.D(fake), zeros)
        ) / 2
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.losses.append((float(g_loss), float(d_loss)))


def trainer(strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2 * STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def real_samples() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(0))), batch_size=4)


def train(strategy) -> list[tuple[float, float]]:
    L.seed_everything(0, verbose=False)
    model = GAN()
    trainer(strategy).fit(model, real_samples())
    return model.losses


def gan_cases() -> dict:
    return {
        "ddp": train(DDPStrategy(find_unused_parameters=True)),
        "fsdp-zero3": train(FastFSDPStrategy(blocks=["Sequential"])),
        "fsdp-zero2": train(FastFSDPStrategy(blocks=["Sequential"], sharding="zero2")),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_with_the_named_blocks_a_gan_trains_as_under_ddp():
    for rank, record in enumerate(run_function(gan_cases, WORLD, init_process_group=False, timeout=300)):
        assert len(record["ddp"]) == STEPS
        for engine in ("fsdp-zero3", "fsdp-zero2"):
            for ours, ddp in zip(record[engine], record["ddp"]):
                assert ours == pytest.approx(ddp, rel=EXACT), f"rank {rank}, {engine}"


def test_a_gan_with_no_block_is_refused_in_one_line_before_any_process_starts(monkeypatch):
    started: list[object] = []
    monkeypatch.setattr("subprocess.Popen", lambda *args, **kwargs: started.append(args))
    expected = (
        r"^blocks: under manual optimization GAN needs blocks \(a backward inside the step does not reduce a model "
        r"sharded as one unit\), and none were found; use blocks: \[Sequential\]\.$"
    )
    with pytest.raises(ValueError, match=expected):
        trainer(FastFSDPStrategy()).fit(GAN(), real_samples())
    assert started == []


def test_a_module_with_parameters_of_its_own_only_is_told_to_move_them():
    class OneWeight(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match="; move its parameters into a submodule the step calls.$"):
        FastFSDPStrategy().check_names(OneWeight())


def test_automatic_optimization_keeps_its_root_unit():
    model = GAN()
    model.automatic_optimization = True
    FastFSDPStrategy().check_names(model)  # the root's gradients are reduced after the step: nothing to refuse
