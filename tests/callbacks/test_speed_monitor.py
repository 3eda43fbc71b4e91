"""SpeedMonitor: consistent throughput figures on logging steps only, and the peak-FLOPs table."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdist import SpeedMonitor, SyncFreeLogging, count_host_syncs
from lightning_fastdist.callbacks.speed_monitor import default_units
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.diagnostics.peak_flops import matmul_dtype, peak_flops
from tests.callbacks.test_sync_free_logging import LabelSteps, read_csv


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10", "fp32", 31.2),
    ],
)
def test_peak_flops_table(name, dtype, tflops):
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_gpus_and_missing_dtypes_give_none_and_bad_dtype_raises():
    assert peak_flops("NVIDIA A10G", "bf16") is None  # not the A10
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # V100 has no bf16
    with pytest.raises(ValueError, match="dtype must be one of"):
        peak_flops("NVIDIA H100", "int8")


def test_precision_maps_to_a_matmul_dtype():
    assert [matmul_dtype(p) for p in ("bf16-mixed", "bf16-true", "16-mixed")] == ["bf16", "bf16", "fp16"]
    assert matmul_dtype("32-true") in ("fp32", "tf32")


def test_samples_always_tokens_only_for_token_ids():
    assert default_units((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16))) == {"samples": 4, "tokens": 64}
    assert default_units({"image": torch.zeros(32, 3, 8, 8), "label": torch.zeros(32, dtype=torch.long)}) == {
        "samples": 32
    }
    assert default_units([torch.zeros(8, 20)]) == {"samples": 8}  # tabular features are not tokens
    assert default_units(["text"]) == {}


class SmallCNN(L.LightningModule):
    """A plain-torch image classifier: 3 x 8 x 8 images, 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PixelSpeed(SpeedMonitor):
    """Counts images and pixels as well, through the documented extension point."""

    def count_units(self, batch):
        images = batch[0]
        return {**super().count_units(batch), "pixels": images.shape[0] * images.shape[2] * images.shape[3]}


def test_an_image_classifier_logs_samples_and_its_own_units_never_tokens(tmp_path):
    images = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, log_every_n_steps=2, logger=CSVLogger(tmp_path), enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False, callbacks=[PixelSpeed()],
    )  # fmt: skip
    trainer.fit(SmallCNN(), DataLoader(images, batch_size=16))
    rows = [r for r in read_csv(Path(trainer.logger.log_dir) / "metrics.csv") if r.get("speed/samples_per_sec")]
    assert [int(r["step"]) for r in rows] == [1, 3]
    assert not any(name.startswith(("speed/tokens", "speed/tflops", "speed/mfu")) for name in rows[0])
    for row in rows:
        assert float(row["speed/pixels_per_sec"]) == pytest.approx(64 * float(row["speed/samples_per_sec"]), rel=1e-9)


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="flops_per_token must be > 0 or None"):
        SpeedMonitor(flops_per_token=0)
    with pytest.raises(ValueError, match="peak_flops_per_device must be > 0 or None"):
        SpeedMonitor(peak_flops_per_device=-1.0)


def test_figures_are_consistent_logged_on_log_steps_only_and_cost_no_sync(tmp_path):
    peak, log_every, steps = 1e11, 2, 6
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=16)
    syncs = count_host_syncs(device="cpu")
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, log_every_n_steps=log_every, logger=CSVLogger(tmp_path),
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, enable_progress_bar=False,
        callbacks=[LabelSteps(syncs), SyncFreeLogging(), SpeedMonitor(peak_flops_per_device=peak)],
    )  # fmt: skip
    with syncs:
        trainer.fit(model, TextDataModule(batch_size=4, block_size=16))
    rows = [r for r in read_csv(Path(trainer.logger.log_dir) / "metrics.csv") if r["speed/samples_per_sec"]]
    assert [int(r["step"]) for r in rows] == [s for s in range(steps) if (s + 1) % log_every == 0]
    for row in rows:
        samples, tokens = float(row["speed/samples_per_sec"]), float(row["speed/tokens_per_sec"])
        assert samples > 0 and tokens == pytest.approx(samples * 16, rel=1e-6)
        assert float(row["speed/ranks"]) == 1
        assert float(row["speed/tflops_per_sec"]) == pytest.approx(tokens * model.flops_per_token / 1e12, rel=1e-6)
        assert float(row["speed/mfu"]) == pytest.approx(tokens * model.flops_per_token / peak, rel=1e-6)
    counts = syncs.counts_by_label()
    assert all(counts[s] == 0 for s in range(steps) if (s + 1) % log_every), syncs.report()
