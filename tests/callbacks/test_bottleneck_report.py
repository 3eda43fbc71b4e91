"""BottleneckReport on 2 real gloo processes.

Each purpose-built bottleneck is flagged, a clean run is not, files are written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import Dataset

from lightning_fastdist import BottleneckReport, FastDDPStrategy, FastFSDPStrategy, FastMixedPrecision, SyncFreeLogging
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.diagnostics import bottleneck_checks as checks
from tests.support.harness import run_function

SLOW_SAMPLE_SECONDS = 0.01  # x 16 samples per batch: far longer than a step of this model


class ReadsLossEveryStep(TinyGPT):
    """Calls ``.item()`` on the loss in every training step (a host sync per step)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()
        return loss


class AccumulatesWithoutNoSync(TinyGPT):
    """Manual optimization that accumulates 2 micro-batches.

    Yet it lets DDP (or FSDP) sync gradients after each backward.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        inputs, targets = batch
        self.manual_backward(self._loss(self(inputs), targets) / 2)  # no block_backward_sync(): a round per micro-batch
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()


class SlowSamples(Dataset):
    """A dataset whose every sample takes :data:`SLOW_SAMPLE_SECONDS` to load."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        time.sleep(SLOW_SAMPLE_SECONDS)
        return self.dataset[index]


class SlowData(TextDataModule):
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if not isinstance(self.train_set, SlowSamples):
            self.train_set = SlowSamples(self.train_set)


def model(cls=TinyGPT) -> TinyGPT:
    torch.manual_seed(0)
    return cls(n_layer=2, n_embd=64, n_head=2, block_size=64)


def run_case(name: str, root: str) -> dict:
    """Fit one case on this rank; return the report's rows and files."""
    module, data = model(), TextDataModule(batch_size=16, block_size=64)
    strategy = FastDDPStrategy()
    plugins = [FastMixedPrecision("bf16-mixed", device="cpu")]
    accumulate = 2
    if name == "host_sync":
        module = model(ReadsLossEveryStep)
    elif name == "data_bound":
        data = SlowData(batch_size=16, block_size=64)
    elif name == "tiny_bucket":
        strategy = FastDDPStrategy(bucket_cap_mb=0.01)
    elif name == "fp32":
        plugins = []
    elif name == "allreduce_every_micro_batch":
        module, accumulate = model(AccumulatesWithoutNoSync), 1
    elif name == "fsdp_reduce_scatter_every_micro_batch":
        module, accumulate, strategy = model(AccumulatesWithoutNoSync), 1, FastFSDPStrategy()
    report = BottleneckReport(start_step=2, num_steps=6, host_sync_steps=3)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=plugins, max_steps=6,
        accumulate_grad_batches=accumulate, callbacks=[report, SyncFreeLogging()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=f"{root}/{name}",
    )  # fmt: skip
    trainer.fit(module, data)
    return {
        "statuses": {row.check: row.status for row in report.rows},
        "measured": {row.check: row.measured for row in report.rows},
        "fixes": {row.check: row.fix for row in report.rows},
        "paths": [str(p) for p in report.paths],
    }


CASES = {  # case -> the row that must be flagged
    "clean": None,
    "host_sync": "host syncs",
    "data_bound": "data wait",
    "tiny_bucket": "gradient buckets",
    "fp32": "precision",
    "allreduce_every_micro_batch": "gradient sync rounds",
    "fsdp_reduce_scatter_every_micro_batch": "gradient sync rounds",
}


def all_cases(root: str) -> dict:
    return {name: run_case(name, root) for name in CASES}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_bottleneck_is_flagged_and_a_clean_run_is_not(tmp_path):
    results = run_function(all_cases, world_size=2, args=(str(tmp_path),), timeout=240, init_process_group=False)
    for rank, by_case in enumerate(results):
        for name, expected in CASES.items():
            flagged = {check for check, status in by_case[name]["statuses"].items() if status == "WARN"}
            if expected is None:
                assert flagged == set(), (rank, by_case[name]["measured"])
            else:
                # More all-reduces (tiny buckets, one per micro-batch) may also, rightly, cost communication time.
                assert expected in flagged and flagged <= {expected, "communication"}, (
                    rank,
                    name,
                    by_case[name]["measured"],
                )
    rank0 = results[0]
    assert "test_bottleneck_report.py" in rank0["host_sync"]["measured"]["host syncs"]  # names the line with .item()
    for name in ("allreduce_every_micro_batch", "fsdp_reduce_scatter_every_micro_batch"):
        assert rank0[name]["measured"]["gradient sync rounds"].startswith("2.00 per optimizer step")
        assert rank0[name]["statuses"]["communication"] in ("OK", "WARN")  # counted, so re-sent and timed
    assert "bucket_cap_mb: auto" in rank0["tiny_bucket"]["fixes"]["gradient buckets"]
    assert "precision: bf16-mixed" in rank0["fp32"]["fixes"]["precision"]
    assert results[1]["clean"]["paths"] == []  # only rank 0 writes
    for name in CASES:
        json_path, markdown_path = map(Path, rank0[name]["paths"])
        assert json_path.parent == tmp_path / name
        written = json.loads(json_path.read_text())
        assert {r["check"]: r["status"] for r in written["rows"]} == rank0[name]["statuses"]
        assert len(written["details"]["ranks"]) == 2
        assert "| check | status | measured |" in markdown_path.read_text()
    assert "```yaml\ntrainer:\n  precision: null" in (tmp_path / "fp32" / "bottleneck_report.md").read_text()


def test_checks_turn_measurements_into_rows():
    assert checks.check_data_wait(0.5, 0.1, 3).status == "WARN"
    assert "num_workers: 3" in checks.check_data_wait(0.5, 0.1, 3).fix
    assert checks.check_data_wait(0.05, 0.001, 3).status == "OK"
    assert checks.check_comm_rounds(None, 4).status == "N/A"
    assert "comm_hook: bf16" in checks.check_comm_time(0.5, 1.0).fix
    assert "sharding: zero2" in checks.check_comm_time(0.5, 1.0, sharded=True).fix
    assert checks.check_comm_time(0.1, 1.0, sharded=True).status == "OK"
    assert checks.check_comm_rounds(8, 4).status == "WARN" and checks.check_comm_rounds(4, 4).status == "OK"
    assert checks.check_buckets(2**20, 10 * 2**20).status == "OK"
    assert checks.check_buckets(10_000, 10 * 2**20).status == "WARN"
    assert checks.check_buckets(10_000, 5_000).status == "OK"  # one bucket holds everything
    assert checks.check_precision("32-true", True, "cpu").status == "WARN"
    assert checks.check_precision("32-true", False, "cuda").status == "OK"
    assert checks.check_memory(95, 100, "GPU").status == "WARN"
    assert checks.check_recompiles(1).status == "WARN"
    rows = [checks.check_recompiles(0), checks.check_recompiles(2)]
    assert "Fix for recompiles:" in checks.render_text(rows)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(start_step=-1), "start_step must be an integer >= 0, got -1"),
        (dict(num_steps=1), "num_steps must be an integer >= 2, got 1"),
        (dict(host_sync_steps=0), "host_sync_steps must be an integer >= 1, got 0"),
        (dict(filename="a/b"), "filename must be a non-empty file stem"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        BottleneckReport(**options)


def test_a_run_shorter_than_the_window_writes_nothing(tmp_path):
    report = BottleneckReport(start_step=5, num_steps=5)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, callbacks=[report], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model(), TextDataModule(batch_size=4, block_size=64))
    assert report.rows == [] and report.paths == [] and not list(tmp_path.rglob("bottleneck_report.*"))
