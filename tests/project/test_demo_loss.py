"""TinyGPT's loss paths and attention kernels: the chunked loss is the full one (value and gradients) without the
batch's logits; a pinned SDPA kernel computes what torch's choice does; bad values are refused in one line."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdist.demo import TinyGPT, loss

SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300)


def twins(**options) -> tuple[TinyGPT, TinyGPT]:
    """Two models with the same weights: the full loss path and ``options``."""
    torch.manual_seed(0)
    full = TinyGPT(**SMALL)
    other = TinyGPT(**SMALL, **options)
    other.load_state_dict(full.state_dict())
    return full, other


def loss_and_gradients(model: TinyGPT, inputs, targets, bf16: bool = False) -> tuple[torch.Tensor, dict]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        value = model(inputs, targets)
    value.backward()
    return value.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize(("bf16", "tolerance"), [(False, 1e-6), (True, 2e-3)])
def test_the_chunked_loss_is_the_full_loss_in_value_and_gradients(monkeypatch, bf16, tolerance):
    monkeypatch.setattr(loss, "CHUNK_LOGITS", 300 * 5)  # 5 rows a chunk: 64 rows make 12 full chunks and a short one
    full, chunked = twins(loss_path="chunked")
    inputs, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 300, (4, 16))
    expected, expected_gradients = loss_and_gradients(full, inputs, targets, bf16)
    value, gradients = loss_and_gradients(chunked, inputs, targets, bf16)
    assert value.dtype == torch.float32 and value.item() == pytest.approx(expected.item(), rel=1e-6)
    for name, gradient in gradients.items():
        assert torch.allclose(gradient, expected_gradients[name], atol=tolerance, rtol=0), name
    # forward(inputs, targets) is the step's loss: the logits' cross-entropy, as validation computes it.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        assert expected.item() == pytest.approx(TinyGPT._loss(full(inputs), targets).item(), rel=1e-6)


def test_without_gradients_the_chunked_loss_keeps_none(monkeypatch):
    _, chunked = twins(loss_path="chunked")
    with torch.no_grad():
        value = chunked(torch.randint(0, 256, (2, 16)), torch.randint(0, 300, (2, 16)))
    assert value.grad_fn is None and value.item() > 0


def test_a_pinned_attention_kernel_computes_what_torchs_choice_does():
    auto, pinned = twins(attention="math")
    inputs = torch.randint(0, 256, (2, 16))
    assert torch.allclose(auto(inputs), pinned(inputs), atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(loss_path="fused"), "loss_path must be one of full, chunked; got 'fused'"),
        (dict(attention="tri"), "attention must be one of auto, flash, cudnn, efficient, math; got 'tri'"),
    ],
)
def test_bad_values_name_the_field_and_what_it_accepts(options, message):
    with pytest.raises(ValueError, match=message):
        TinyGPT(**SMALL, **options)
