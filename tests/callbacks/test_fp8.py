"""fp8 training (torchao float8): which layers the shape filter picks, the one-line refusals, and the conversion
trained on the CPU through torchao's emulation (the plumbing; fp8 speed needs an H100 or newer: docs/precision.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_fastdist import FastMixedPrecision
from lightning_fastdist.demo import TinyGPT
from lightning_fastdist.parallel.precision.fp8 import (
    convert_to_fp8,
    converted_layers,
    fp8_layers,
    fp8_unavailable,
    layer_verdicts,
    no_layer_reason,
)
from tests.support.harness import run_function
from tests.support.workloads import make_trainer, repeated_batches

NARROW = "too narrow to pay (tensorwise converts in_features > 4096 or out_features > 1024)"


def on_meta(build):
    """A model built without memory: the filter reads shapes only."""
    with torch.device("meta"):
        return build()


def test_on_gpt2_small_tensorwise_picks_qkv_and_the_mlp_widening_and_says_why_not_the_rest():
    model = on_meta(lambda: TinyGPT(n_layer=2, n_head=12, n_embd=768, block_size=1024, vocab_size=50304))
    verdicts = layer_verdicts(model)
    assert fp8_layers(model) == ["blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.1.attn.qkv", "blocks.1.mlp.up"]
    assert verdicts["blocks.0.attn.proj"] == verdicts["blocks.0.mlp.down"] == NARROW  # 768 -> 768, 3072 -> 768
    assert verdicts["lm_head"] == "skipped by name ('lm_head')"
    assert fp8_layers(model, skip=()) == [*fp8_layers(model), "lm_head"]  # 768 -> 50304 would qualify


def test_at_2048_wide_tensorwise_takes_every_block_layer_and_rowwise_the_widest():
    model = on_meta(lambda: TinyGPT(n_layer=1, n_head=16, n_embd=2048, block_size=1024, vocab_size=50304))
    assert fp8_layers(model) == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.up", "blocks.0.mlp.down"]
    assert fp8_layers(model, "rowwise") == ["blocks.0.attn.qkv", "blocks.0.mlp.up"]


def test_on_huggingface_models_llama_keeps_its_narrow_kv_projections_and_gpt2_has_no_linear_layer():
    llama = AutoConfig.for_model("llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # fmt: skip
    model = on_meta(lambda: AutoModelForCausalLM.from_config(llama))
    picked = [name.rsplit(".", 1)[-1] for name in fp8_layers(model)]
    assert picked == ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert layer_verdicts(model)["model.layers.0.self_attn.k_proj"] == NARROW  # 2048 -> 512 (grouped-query)
    gpt2 = on_meta(lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1)))
    assert fp8_layers(gpt2) == []  # its blocks are Conv1D; the tied head is skipped by name
    assert "skipped by name ('lm_head')" in no_layer_reason(gpt2, "tensorwise", ("lm_head",))


def test_a_model_with_nothing_to_convert_is_refused_in_one_line():
    model = TinyGPT(n_layer=1, n_head=2, n_embd=32)
    with pytest.raises(ValueError) as refused:
        convert_to_fp8(model)
    message = str(refused.value)
    assert message.startswith("fp8: none of the 5 linear layers of TinyGPT qualifies for tensorwise fp8: ")
    assert NARROW in message and message.endswith("train in bf16-mixed.") and "\n" not in message
    assert "has no nn.Linear layer" in no_layer_reason(torch.nn.Sequential(torch.nn.ReLU()), "tensorwise", ())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(fp8="tensorwise", device="cpu"),
            "fp8='tensorwise' is refused: fp8 matmuls need a CUDA GPU of compute "
            r"capability 8.9 or newer \(H100, H200, L4, L40S, ...\); this run has none.",
        ),  # fmt: skip
        (dict(fp8="rowwise", device="cpu"), "compute capability 9.0 or newer"),
        (dict(fp8="e4m3", device="cpu"), "fp8 must be null or one of tensorwise, rowwise; got 'e4m3'"),
        (dict(fp8="tensorwise", precision="16-mixed", device="cuda"), "fp8 trains beside bf16-mixed or bf16-true"),
        (dict(fuse_optimizers="sometimes"), "fuse_optimizers must be one of true, false, 'always'; got 'sometimes'"),
    ],
)
def test_fp8_and_fusion_settings_that_cannot_run_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FastMixedPrecision(**kwargs)


def test_without_a_gpu_the_hardware_is_the_reason_whatever_is_installed():
    assert fp8_unavailable("cpu").startswith("fp8 matmuls need a CUDA GPU of compute capability 8.9")


def test_converted_layers_train_under_bf16_autocast_and_compile_with_torchaos_emulation():
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, n_head=2, n_embd=272, block_size=16)  # 272 -> 1088: one layer per block qualifies
    assert convert_to_fp8(model, emulate=True) == ["blocks.0.mlp.up", "blocks.1.mlp.up"]
    assert converted_layers(model) == ["blocks.0.mlp.up", "blocks.1.mlp.up"]
    assert model.lm_head.weight is model.token_embedding.weight  # the tied head is left as it was
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = torch.compile(model, backend="aot_eager")
    tokens = torch.randint(0, 256, (4, 17))
    losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_fuse_optimizers_always_fuses_adamw_under_bf16_too():
    plugin = FastMixedPrecision("bf16-mixed", device="cpu", fuse_optimizers="always")
    trainer = make_trainer("auto", devices=1, max_steps=1, plugins=[plugin])
    model = TinyGPT(n_layer=1, n_head=2, n_embd=32, block_size=16)
    trainer.fit(model, repeated_batches())
    [optimizer] = trainer.optimizers
    assert all(group["fused"] for group in optimizer.param_groups)
    default = make_trainer("auto", devices=1, max_steps=1, plugins=[FastMixedPrecision("bf16-mixed", device="cpu")])
    default.fit(TinyGPT(n_layer=1, n_head=2, n_embd=32, block_size=16), repeated_batches())
    assert not any(group.get("fused") for group in default.optimizers[0].param_groups)  # only 16-mixed needs it


def gathered_bytes(fp8_all_gather: bool) -> tuple[int, float]:
    """One step of a one-block model under FSDP2 on 2 gloo ranks; the bytes all-gathered, and the loss."""
    import torch.distributed as dist  # noqa: PLC0415 - in the rank's process
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from lightning_fastdist.parallel.comm.accounting import CommStats  # noqa: PLC0415
    from lightning_fastdist.parallel.fsdp.comm_accounting import count_fsdp_communication  # noqa: PLC0415
    from lightning_fastdist.parallel.precision.fp8 import precompute_fp8_scales  # noqa: PLC0415

    torch.manual_seed(0)
    model = TinyGPT(n_layer=1, n_head=2, n_embd=272, block_size=16)
    if fp8_all_gather:
        convert_to_fp8(model, fsdp_all_gather=True, emulate=True)
    units = [fully_shard(model.blocks[0]), fully_shard(model)]
    stats = CommStats()
    count_fsdp_communication(units, stats, replicated=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    if fp8_all_gather:
        precompute_fp8_scales(model)  # one all-reduce for every fp8 weight's scale, for the next gathers
        assert model.blocks[0].mlp.up.weight._local_tensor._precomputed_scale is not None
    return stats.totals["allgather"].bytes, loss.item()


@pytest.mark.multiprocess
def test_under_fsdp2_the_converted_weights_are_all_gathered_in_fp8():
    pytest.importorskip("torchao.float8")
    (fp8_bytes, fp8_loss), _ = run_function(gathered_bytes, 2, args=(True,))
    (fp32_bytes, fp32_loss), _ = run_function(gathered_bytes, 2, args=(False,))
    # mlp.up (272 x 1088) is gathered for the forward and again for the backward: 1 byte an element, not 4.
    assert fp32_bytes - fp8_bytes == 2 * 272 * 1088 * (4 - 1)
    assert fp8_loss == pytest.approx(fp32_loss, rel=0.01)  # fp8's rounding, emulated
