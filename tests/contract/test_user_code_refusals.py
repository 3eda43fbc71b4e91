"""Finding, before the first step, the Lightning patterns an engine refuses (in one line), and the grad_norm they are
told to use instead. The refusals of whole fits: test_contract_resume_and_callbacks.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch import utilities
from lightning.pytorch.callbacks import Callback, LearningRateFinder, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities import grad_norm as lightnings
from torch import nn

import lightning_fastdist
from lightning_fastdist.strategies.common.unsupported import (
    DEEPSPEED_REFUSALS,
    FSDP_REFUSALS,
    refuse_unsupported,
)


class Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)


class GlobalName(Plain):
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(lightnings(self, 2))


class ModuleAttribute(Plain):
    def on_after_backward(self):
        self.log_dict(utilities.grad_norm(self, 2))


class Ours(Plain):
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(lightning_fastdist.grad_norm(self, 2))


class Clipping(Plain):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, 1.0, "norm")


def trainer_with(module: L.LightningModule, *callbacks: Callback) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", callbacks=list(callbacks), logger=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    return trainer


def closing_over() -> L.LightningModule:
    from lightning.pytorch.utilities import grad_norm  # a local import: the hook closes over it

    class Closure(Plain):
        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, 2))

    return Closure()


@pytest.mark.parametrize("module", [GlobalName(), ModuleAttribute(), closing_over()], ids=["global", "attr", "closure"])
def test_lightnings_grad_norm_is_found_however_the_hook_reaches_it(module):
    with pytest.raises(
        ValueError, match=r"^FastFSDPStrategy: \w+\.on_\w+ calls Lightning's grad_norm, which reads each"
    ):
        refuse_unsupported(trainer_with(module), "FastFSDPStrategy", FSDP_REFUSALS)


def test_ours_and_plain_code_pass_and_each_deepspeed_refusal_is_one_line():
    for module in (Ours(), Plain()):
        refuse_unsupported(trainer_with(module), "FastFSDPStrategy", FSDP_REFUSALS)
        refuse_unsupported(trainer_with(module), "FastDeepSpeedStrategy", DEEPSPEED_REFUSALS)
    refusals = [
        (trainer_with(Clipping()), "FastDeepSpeedStrategy: Clipping overrides configure_gradient_clipping, and"),
        (trainer_with(Plain(), LearningRateFinder()), "FastDeepSpeedStrategy: LearningRateFinder (Tuner.lr_find)"),
    ]
    for trainer, start in refusals:
        with pytest.raises(ValueError) as refused:
            refuse_unsupported(trainer, "FastDeepSpeedStrategy", DEEPSPEED_REFUSALS)
        assert str(refused.value).startswith(start) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"^FastFSDPStrategy: WeightAveraging keeps an unsharded copy of the model"):
        refuse_unsupported(trainer_with(Plain(), WeightAveraging()), "FastFSDPStrategy", FSDP_REFUSALS)
    with pytest.raises(
        ValueError, match=r"^FastFSDPStrategy: StochasticWeightAveraging keeps an unsharded copy"
    ) as swa:
        refuse_unsupported(trainer_with(Plain(), StochasticWeightAveraging(0.05)), "FastFSDPStrategy", FSDP_REFUSALS)
    assert "use FastDDPStrategy for stochastic weight averaging" in str(swa.value) and "\n" not in str(swa.value)


@pytest.mark.parametrize("norm_type", [2, 1.0, "inf"])
def test_our_grad_norm_gives_lightnings_names_and_values_on_plain_gradients(norm_type):
    module = Plain()
    module.layer(torch.randn(4, 3)).square().sum().backward()
    ours, theirs = lightning_fastdist.grad_norm(module, norm_type), lightnings(module, norm_type)
    assert ours.keys() == theirs.keys() and len(ours) == 3
    assert all(torch.allclose(ours[name], theirs[name]) for name in ours)


def test_our_grad_norm_refuses_a_norm_that_is_not_positive():
    with pytest.raises(ValueError, match=r"^grad_norm: norm_type must be a positive number or 'inf', got 0.0.$"):
        lightning_fastdist.grad_norm(Plain(), 0)
