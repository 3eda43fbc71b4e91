"""FastFSDPStrategy with a LightningModule that never calls ``self(...)``.

Every step reaches its model as ``self.model``.

On 2 gloo processes, a HuggingFace GPT-2 wrapped the HuggingFace way trains with gradient
accumulation (one reduce-scatter round per optimizer step), validates, tests and predicts
through ``self.model``, trains under manual optimization, saves a checkpoint under the
LightningModule's own parameter names and resumes from it with the losses of an
uninterrupted run. Parameterless modules and ``LightningModule.device`` end on the root device.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdist.strategies.fsdp.sharded_module import move_all_but_parameters
from tests.support.harness import run_function
from tests.support.model_zoo import HFCausalLM


class EveryStep(HFCausalLM):
    """GPT-2 whose validation, test and predict steps call ``self.model`` too, fed one sample over and over.

    Every batch being the same, a resumed run's losses depend only on the restored state, not on where
    (and in which order) Lightning reads a plain DataLoader after the restart.
    """

    def batches(self, batch_size: int = 4) -> DataLoader:
        sample = next(iter(super().batches(batch_size)))[0][:1]
        return DataLoader(TensorDataset(sample.repeat(64, 1)), batch_size=batch_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens).logits.argmax(-1)


class ManualOptimization(EveryStep):
    """The same model stepping its optimizer itself (``manual_backward`` inside the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()


def every_call_path(folder: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fastdist import FastFSDPStrategy
    from tests.support.workloads import LossRecorder, make_trainer

    def fit(model, max_steps: int, ckpt_path: str | None = None, callbacks=(), **options) -> tuple:
        strategy, losses = FastFSDPStrategy(checkpoint_format="full"), LossRecorder()
        trainer = make_trainer(strategy, max_steps=max_steps, callbacks=[losses, *callbacks], **options)
        trainer.fit(model, model.batches(), ckpt_path=ckpt_path)
        return trainer, strategy, losses.losses

    result = {}
    trainer, strategy, _ = fit(EveryStep(), 2, accumulate_grad_batches=2, limit_val_batches=2)
    result["rounds"] = strategy.comm_stats.rounds  # gradient reduce-scatter rounds: one per optimizer step
    model = trainer.lightning_module
    with torch.no_grad():  # called directly, outside any step (the root is sharded now), as a callback would
        direct = model(next(iter(model.batches()))[0]).argmax(-1)
    result["validate"] = trainer.validate(model, model.batches(), verbose=False)[0]["val_loss"]
    result["test"] = trainer.test(model, model.batches(), verbose=False)[0]["test_loss"]
    predictions = trainer.predict(model, model.batches())
    result["predictions"] = [p.shape for p in predictions]
    result["direct_call_predicts_alike"] = torch.equal(direct, predictions[0])
    result["device"] = (model.device, trainer.strategy.root_device)

    every_step = ModelCheckpoint(folder, "{step}", every_n_train_steps=1, save_top_k=-1)
    _, _, straight = fit(EveryStep(), 4, callbacks=[every_step], enable_checkpointing=True)
    path = os.path.join(folder, "step=2.ckpt")
    _, _, resumed = fit(EveryStep(), 4, ckpt_path=path)
    result["straight"], result["resumed"] = straight, resumed
    result["checkpoint_keys"] = sorted(torch.load(path, weights_only=False)["state_dict"])
    result["module_keys"] = sorted(EveryStep().state_dict())
    result["manual"] = fit(ManualOptimization(), 4)[2]
    return result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_module_calling_self_model_trains_evaluates_predicts_and_resumes_under_fsdp(tmp_path):
    ranks = run_function(every_call_path, 2, args=(str(tmp_path),), init_process_group=False, timeout=300)
    for rank in ranks:
        assert rank["rounds"] == 2  # 4 micro-batches, accumulation 2: no reduce-scatter on the odd ones
        assert 3.5 < rank["validate"] < 4.5 and 3.5 < rank["test"] < 4.5  # about ln(64) for an untrained model
        assert rank["predictions"] == [torch.Size([4, 16])] * 8  # 64 samples over 2 ranks in batches of 4
        assert rank["device"][0] == rank["device"][1]
        assert rank["direct_call_predicts_alike"]
        assert rank["checkpoint_keys"] == rank["module_keys"]  # no "module." prefix from the root around it
        assert rank["resumed"] == pytest.approx(rank["straight"][2:], rel=1e-6)
        assert rank["manual"] == pytest.approx(rank["straight"], rel=1e-6)  # the same steps, stepped by hand
    assert ranks[0]["validate"] == pytest.approx(ranks[1]["validate"])  # synchronised across ranks


class Metric(nn.Module):
    """A parameterless module with a buffer, like a torchmetrics metric."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))


class Holder(_DeviceDtypeModuleMixin):
    """A module with parameters and a device attribute, like a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.metric = Metric()


def test_under_cpu_offload_everything_but_the_parameters_moves_to_the_device():
    holder = Holder()
    move_all_but_parameters(holder, torch.device("meta"))  # stands for the GPU: any device other than the CPU
    assert holder.metric.total.is_meta and holder.device == torch.device("meta")
    assert not any(p.is_meta for p in holder.parameters())  # the offloaded shards stay on the CPU
