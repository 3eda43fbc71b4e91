"""The memory estimate: its arithmetic, its refusals, and agreement with bytes measured on 2 real ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.demo import Block, TinyGPT
from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding
from lightning_fastdist.parallel.plan.activation_checkpointing import apply_activation_checkpointing
from lightning_fastdist.planning.activation_memory import ActivationMemory
from lightning_fastdist.planning.memory_model import TrainingShape, activation_bytes, estimate_memory, estimate_table
from tests.support.harness import run_function

TINY = dict(n_layer=4, n_embd=128, n_head=4, block_size=128)
BATCH = 8


def shape_of(model: TinyGPT, world_size: int, precision: str = "32-true") -> TrainingShape:
    hp = model.hparams
    return TrainingShape(
        parameters=model.num_parameters(), layers=hp.n_layer, hidden=hp.n_embd, seq_len=hp.block_size,
        micro_batch=BATCH, world_size=world_size, vocab_size=hp.vocab_size, precision=precision,
    )  # fmt: skip


def test_ddp_holds_16_bytes_per_parameter_and_zero_shards_them():
    shape = TrainingShape(parameters=1_000_000, layers=4, hidden=128, seq_len=128, micro_batch=8, world_size=4)
    ddp = estimate_memory(shape, "ddp")
    assert (ddp.weights, ddp.gradients, ddp.optimizer, ddp.gathered_weights) == (4_000_000, 4_000_000, 8_000_000, 0)
    zero3 = estimate_memory(shape, "zero3")
    assert zero3.state == 4_000_000 and zero3.gathered_weights == 2 * 4_000_000 // 4
    zero2 = estimate_memory(shape, "zero2")
    assert zero2.state == 4_000_000 and zero2.gathered_weights == 4_000_000
    offloaded = estimate_memory(shape, "zero3", cpu_offload=True)
    assert offloaded.state == 0 and offloaded.host_bytes == 4_000_000
    assert estimate_memory(shape, "ddp", gradient_as_bucket_view=False).gradients == 8_000_000


def test_deepspeed_keeps_an_fp32_master_copy_and_offloads_the_optimizer():
    shape = TrainingShape(parameters=1_000_000, layers=4, hidden=128, seq_len=128, micro_batch=8, world_size=4)
    buckets = 2 * 4 * 1_000_000  # two reduction buckets as large as the model (the "auto" size)
    zero1, zero2, zero3 = (estimate_memory(shape, mode) for mode in ("ds-zero1", "ds-zero2", "ds-zero3"))
    assert (zero1.weights, zero1.gradients, zero1.optimizer) == (4_000_000, 4_000_000 + buckets, 3_000_000)
    assert (zero2.weights, zero2.gradients, zero2.optimizer) == (4_000_000, 1_000_000 + buckets, 3_000_000)
    assert (zero3.weights, zero3.gradients) == (1_000_000, 1_000_000)
    assert (zero3.optimizer, zero3.gathered_weights) == (3_000_000, 4_000_000)
    assert zero3.state == 20 * 1_000_000 // 4  # 20 bytes per parameter in fp32, all sharded
    bf16 = estimate_memory(TrainingShape(**{**shape.__dict__, "precision": "bf16-mixed"}), "ds-zero3")
    assert bf16.state == 16 * 1_000_000 // 4  # the ZeRO paper's 2 + 2 + 12
    offload2 = estimate_memory(shape, "ds-zero2", cpu_offload=True)
    assert offload2.optimizer == 0 and offload2.host_bytes == 3_000_000 and offload2.weights == 4_000_000
    offload3 = estimate_memory(shape, "ds-zero3", cpu_offload=True)
    assert offload3.weights == offload3.optimizer == 0 and offload3.host_bytes == 4_000_000


def test_checkpointing_and_bf16_lower_the_activations():
    shape = TrainingShape(parameters=10**6, layers=12, hidden=768, seq_len=1024, micro_batch=4)
    none, selective, full = (activation_bytes(shape, mode) for mode in ("none", "selective", "full"))
    assert full < selective < none
    mixed = TrainingShape(**{**shape.__dict__, "precision": "bf16-mixed"})
    assert activation_bytes(mixed) < none
    assert len(estimate_table(shape)) == 2 + 4 + 4 + 3 * 4  # DDP, FSDP's two, DeepSpeed's three (offload too)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: TrainingShape(parameters=0, layers=1, hidden=1, seq_len=1, micro_batch=1),
            "parameters must be an integer >= 1, got 0",
        ),
        (
            lambda: TrainingShape(1, 1, 1, 1, 1, precision="fp8"),
            "precision must be one of 32-true, bf16-mixed, 16-mixed, bf16-true, got 'fp8'",
        ),
        (
            lambda: estimate_memory(TrainingShape(1, 1, 1, 1, 1), "zero1"),
            "mode must be one of ddp, zero2, zero3, ds-zero1, ds-zero2, ds-zero3, got 'zero1'",
        ),
        (
            lambda: estimate_memory(TrainingShape(1, 1, 1, 1, 1), "ddp", cpu_offload=True),
            "cpu_offload needs a sharded mode",
        ),
        (
            lambda: activation_bytes(TrainingShape(1, 1, 1, 1, 1), "half"),
            "activation_checkpointing must be one of none, selective, full",
        ),
    ],
)
def test_bad_input_names_the_field_and_the_accepted_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_activation_estimate_matches_a_measured_forward_pass():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    inputs = torch.randint(0, 256, (BATCH, 128))
    for mode in ("none", "selective"):
        measured_model = TinyGPT(**TINY)
        apply_activation_checkpointing(measured_model, mode, [Block])
        with ActivationMemory() as memory:
            loss = F.cross_entropy(measured_model(inputs).flatten(0, 1), inputs.flatten())
        assert loss.requires_grad  # the graph, and what it saved, is alive until here
        estimated = activation_bytes(shape_of(model, 1), mode)
        assert estimated == pytest.approx(memory.live_bytes(), rel=0.10), mode


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measured_per_rank_bytes() -> dict:
    """Per rank: weights + gradients + AdamW state after one step, and bytes alive after the next forward."""
    inputs = torch.randint(0, 256, (BATCH, 128), generator=torch.Generator().manual_seed(dist.get_rank()))
    results = {}
    for mode in ("ddp", "zero2", "zero3"):
        torch.manual_seed(0)
        model = TinyGPT(**TINY)
        if mode == "ddp":
            wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            sharding = FSDPSharding(mode)
            sharding.shard(model, sharding.mesh("cpu", 2), [Block])
            wrapped = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # DDP rebuilds its buckets on the second iteration; measure after that
            F.cross_entropy(wrapped(inputs).flatten(0, 1), inputs.flatten()).backward()
            optimizer.step()
        params = list(model.parameters())
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        state_bytes = sum(_local_bytes(t) for t in params + [p.grad for p in params] + states)
        with ActivationMemory() as memory:
            loss = F.cross_entropy(wrapped(inputs).flatten(0, 1), inputs.flatten())
        alive_after_forward = memory.live_bytes()
        loss.backward()
        results[mode] = {"state": state_bytes, "forward": alive_after_forward}
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_estimate_within_10_percent_of_measured_bytes_under_ddp_zero2_zero3():
    shape = shape_of(TinyGPT(**TINY), world_size=2)
    for rank_result in run_function(measured_per_rank_bytes, world_size=2, timeout=240):
        for mode, measured in rank_result.items():
            estimate = estimate_memory(shape, mode)
            assert estimate.state == pytest.approx(measured["state"], rel=0.10), (mode, estimate, measured)
            # Alive after forward: activations, plus (zero2) the gathered weights kept for backward.
            assert estimate.activations + (estimate.gathered_weights if mode == "zero2" else 0) == pytest.approx(
                measured["forward"], rel=0.10
            ), (mode, estimate, measured)
