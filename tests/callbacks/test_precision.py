"""FastMixedPrecision: clear refusals, fused optimizers, and fp16 steps skipped on the device without a host sync."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_fastdist import FastMixedPrecision, SyncFreeLogging, count_host_syncs
from lightning_fastdist.demo import TextDataModule, TinyGPT
from lightning_fastdist.parallel.precision.fused_optimizer import fuse_optimizer
from tests.callbacks.test_sync_free_logging import LabelSteps, read_csv

INIT_SCALE = 2.0**10
INF_STEP = 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(precision="fp8"), r"precision must be one of \('bf16-mixed', '16-mixed', 'bf16-true'\), got 'fp8'"),
        (dict(precision="16-mixed", device="cpu"), "'16-mixed' is refused on device='cpu'.*bf16-mixed"),
        (dict(precision="bf16-mixed", device="tpu"), r"device must be one of \('cuda', 'cpu'\)"),
        (dict(precision="bf16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu")), "scaler is only used with"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FastMixedPrecision(**kwargs)


def test_adam_adamw_sgd_switch_to_fused_in_place_and_others_say_why_not():
    model = torch.nn.Linear(4, 4)
    for optimizer in (torch.optim.Adam(model.parameters()), torch.optim.AdamW(model.parameters()),
                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)):  # fmt: skip
        assert fuse_optimizer(optimizer) is None
        assert optimizer._step_supports_amp_scaling and all(
            g["fused"] and not g["foreach"] for g in optimizer.param_groups
        )
    assert "RMSprop has no fused implementation" in fuse_optimizer(torch.optim.RMSprop(model.parameters()))


def test_a_checkpoint_saved_unfused_is_fused_again_on_load():
    model = torch.nn.Linear(4, 4)
    plain = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    plain.step()
    fused = torch.optim.AdamW(model.parameters())
    fuse_optimizer(fused)
    fused.load_state_dict(plain.state_dict())
    assert all(g["fused"] for g in fused.param_groups)
    assert all(s["step"].dtype == torch.float32 for s in fused.state.values())
    fused.step()  # the fused kernel accepts the restored state


def test_bf16_mixed_autocasts_and_bf16_true_converts_the_module():
    mixed = FastMixedPrecision("bf16-mixed", device="cpu")
    with mixed.forward_context():
        assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.bfloat16
    true = FastMixedPrecision("bf16-true", device="cpu")
    assert true.convert_module(torch.nn.Linear(4, 4)).weight.dtype == torch.bfloat16


class InfGradientGPT(TinyGPT):
    """Puts an inf into one gradient at step ``INF_STEP`` and keeps a copy of the weights around it."""

    def on_after_backward(self):
        if self.trainer.global_step == INF_STEP:
            self.lm_head.weight.grad.view(-1)[0] = float("inf")  # on the device: no host read

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == INF_STEP:
            self.weights_before = {n: p.detach().clone() for n, p in self.named_parameters()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == INF_STEP + 1:
            self.weights_after = {n: p.detach().clone() for n, p in self.named_parameters()}


def test_fp16_inf_gradients_skip_the_step_lower_the_scale_and_never_sync(tmp_path):
    steps, log_every = 6, 3
    plugin = FastMixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
    syncs = count_host_syncs(device="cpu")
    trainer = L.Trainer(
        accelerator="cpu", plugins=[plugin], max_steps=steps, log_every_n_steps=log_every, gradient_clip_val=1.0,
        logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        enable_progress_bar=False, callbacks=[LabelSteps(syncs), SyncFreeLogging()],
    )  # fmt: skip
    model = InfGradientGPT(n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=0)
    with syncs:
        trainer.fit(model, TextDataModule(batch_size=4, block_size=16))

    assert isinstance(trainer.optimizers[0], torch.optim.AdamW) and trainer.optimizers[0].param_groups[0]["fused"]
    for name, before in model.weights_before.items():  # the step with the inf changed nothing
        assert torch.equal(before, model.weights_after[name]), name
    assert all(torch.isfinite(p).all() for p in model.parameters())
    rows = {int(r["step"]): r for r in read_csv(Path(trainer.logger.log_dir) / "metrics.csv") if r["fp16/loss_scale"]}
    assert float(rows[INF_STEP]["fp16/loss_scale"]) == INIT_SCALE / 2  # logged at step INF_STEP (0-based index 2)
    assert float(rows[steps - 1]["fp16/skipped_steps"]) == 1.0
    counts = syncs.counts_by_label()
    assert all(counts[s] == 0 for s in range(steps) if (s + 1) % log_every), syncs.report()
