"""TinyGPT: structure strategies rely on, argument checks, FLOPs estimate, and that it learns."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_fastdist.demo import Block, TextDataModule, TinyGPT
from lightning_fastdist.demo.model import LinearWarmup

SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16)


def test_blocks_are_one_class_in_a_module_list():
    model = TinyGPT(**SMALL)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 2 and all(type(block) is Block for block in model.blocks)


def test_forward_returns_logits_per_position_and_rejects_long_sequences():
    model = TinyGPT(**SMALL)
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.randint(0, 256, (1, 17)))


def test_head_is_tied_to_token_embedding():
    model = TinyGPT(**SMALL)
    assert model.lm_head.weight is model.token_embedding.weight


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_head=3), "n_embd .32. must be divisible by n_head .3."),
        (dict(n_head=0), "n_head must be >= 1"),
        (dict(n_layer=0), "n_layer must be >= 1"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TinyGPT(**{**SMALL, **kwargs})


def test_flops_per_token_matches_a_measured_count():
    model = TinyGPT(n_layer=2, n_head=2, n_embd=64, block_size=32)
    tokens = torch.randint(0, 256, (2, 32))
    with FlopCounterMode(display=False) as counter:
        model._loss(model(tokens), tokens).backward()
    measured_per_token = counter.get_total_flops() / tokens.numel()
    # The estimate ignores layer norms, GELU and softmax, and counts the causal
    # attention at full length, so it sits close to, not exactly on, the count.
    assert measured_per_token == pytest.approx(model.flops_per_token, rel=0.1)


def test_warmup_scheduler_state_is_checkpointable():
    model = TinyGPT(**SMALL, warmup_steps=4)
    config = model.configure_optimizers()
    scheduler = config["lr_scheduler"]["scheduler"]
    assert [LinearWarmup(4)(step) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    state = scheduler.state_dict()
    assert state["lr_lambdas"] == [{"warmup_steps": 4}] * 2  # one per parameter group, plain data
    assert "function" not in repr(state)


def test_weight_decay_skips_biases_norms_and_positions():
    model = TinyGPT(**SMALL)
    optimizer = model.configure_optimizers()["optimizer"]
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert id(model.blocks[0].attn.qkv.weight) in decayed
    assert id(model.blocks[0].attn.qkv.bias) not in decayed
    assert id(model.position_embedding.weight) not in decayed


def test_default_model_and_data_learn_within_60_steps_on_one_core():
    torch.set_num_threads(1)
    L.seed_everything(0)
    losses: list[float] = []

    class RecordLoss(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=60, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[RecordLoss()],
    )  # fmt: skip
    trainer.fit(TinyGPT(), TextDataModule())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert len(losses) == 60
    assert first > 4.5  # near ln(256) = 5.5 at the start
    assert last < first - 1.5, (first, last)
