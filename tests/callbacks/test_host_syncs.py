"""count_host_syncs: what counts as a host sync on CPU standing in for a GPU, and where it came from."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_fastdist import count_host_syncs
from lightning_fastdist.demo import TextDataModule, TinyGPT


def test_value_reads_and_value_sized_ops_count_and_name_their_origin():
    x = torch.tensor([1.5, -2.0])
    with count_host_syncs(device="cpu") as syncs:
        y = x * 2 + 1  # plain arithmetic stays on the device
        _ = y.sum().item()
        _ = float(y.max())
        _ = bool(y[0] > 0)
        _ = y.tolist()
        _ = y.nonzero()
        _ = torch.tensor([1.0], device=torch.device("cpu"))  # on a GPU: a blocking host-to-device copy
    ops = [event.op for event in syncs.events]
    assert ops == ["aten._local_scalar_dense"] * 3 + ["Tensor.tolist", "aten.nonzero", "torch.tensor(device=...)"]
    assert all("test_host_syncs.py" in event.origin for event in syncs.events)
    assert "6 host sync(s)" in syncs.report()


def test_host_side_tensors_of_a_gpu_run_do_not_count():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)  # reads its CPU step counters with .item()
    loader = torch.utils.data.DataLoader(torch.arange(8.0), batch_size=4, shuffle=True)  # shuffles on the host
    with count_host_syncs(device="cpu") as syncs:
        for batch in loader:
            model(batch.view(-1, 4)).sum().backward()
            optimizer.step()
        _ = torch.tensor(0.0, device="cpu")  # the literal "cpu": a deliberate host tensor
    assert syncs.count == 0, syncs.report()


def test_labels_group_events():
    x = torch.ones(2)
    with count_host_syncs(device="cpu") as syncs:
        for step in range(3):
            syncs.label = step
            for _ in range(step):
                x.sum().item()
    assert syncs.counts_by_label() == {1: 1, 2: 2}


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda'\), got 'tpu'"):
        count_host_syncs(device="tpu")
    with pytest.raises(ValueError, match="stack_depth must be >= 1"):
        count_host_syncs(stack_depth=0)
    counter = count_host_syncs(device="cpu")
    with counter, pytest.raises(RuntimeError, match="already active"):
        counter.__enter__()


class LabelSteps(L.Callback):
    """Tags every sync with the index of the training batch it happened in."""

    def __init__(self, syncs):
        self.syncs = syncs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.syncs.label = batch_idx


@pytest.mark.parametrize(("progress_bar", "per_batch"), [(True, 2), (False, 1)])
def test_plain_lightning_costs_what_the_issue_measured(tmp_path, progress_bar, per_batch):
    """Lightning 2.6 converts prog_bar metrics once per batch, and the default bar converts them again."""
    syncs = count_host_syncs(device="cpu")
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, log_every_n_steps=100, logger=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, enable_progress_bar=progress_bar,
        callbacks=[LabelSteps(syncs)], default_root_dir=tmp_path,
    )  # fmt: skip
    with syncs:
        trainer.fit(TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=16), TextDataModule(batch_size=4, block_size=16))
    counts = syncs.counts_by_label()
    assert [counts[step] for step in range(1, 5)] == [per_batch] * 4, syncs.report()
