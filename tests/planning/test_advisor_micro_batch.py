"""The advisor's batch split on big GPUs: the micro-batch grows while the chosen setup still fits, the global batch
kept, up to 64 x 1024 tokens; on a smaller GPU, or without accumulation to trade, it stays as asked."""

from __future__ import annotations

from lightning_fastdist.planning.advisor import GPU_TOKENS_PER_MICRO_BATCH, Target, recommend
from lightning_fastdist.planning.memory_model import TrainingShape

GiB = 2**30
GPT2_SMALL = TrainingShape(124 * 10**6, 12, 768, 1024, 16, vocab_size=50304)


def one_gpu(gib: int) -> Target:
    return Target("gpu", devices=1, device_memory_bytes=gib * GiB, bf16=True, cpu_cores=16)


def test_on_one_h200_gpt2_small_trains_64_sequences_per_micro_batch_without_accumulation():
    choice = recommend(GPT2_SMALL, one_gpu(141), global_batch=64)
    assert (choice.shape.micro_batch, choice.accumulate_grad_batches, choice.estimate.mode) == (64, 1, "ddp")
    assert choice.shape.micro_batch * choice.shape.seq_len == GPU_TOKENS_PER_MICRO_BATCH
    assert choice.reasons[-1].startswith("micro-batch raised to 64: it still fits (")


def test_it_stops_where_memory_ends_and_keeps_the_global_batch():
    tight = recommend(GPT2_SMALL, one_gpu(24), global_batch=64)  # 32 would need more than 20.4 usable GiB
    assert (tight.shape.micro_batch, tight.accumulate_grad_batches) == (16, 4)
    assert tight.estimate.total <= tight.usable_bytes
    middle = recommend(GPT2_SMALL, one_gpu(48), global_batch=64)
    assert middle.shape.micro_batch * middle.accumulate_grad_batches == 64 and 16 < middle.shape.micro_batch < 64


def test_without_accumulation_to_trade_or_on_cpu_nothing_changes():
    assert recommend(GPT2_SMALL, one_gpu(141)).shape.micro_batch == 16  # global batch = micro-batch x devices
    cpu = Target("cpu", devices=1, device_memory_bytes=64 * GiB, bf16=True, cpu_cores=16)
    assert recommend(GPT2_SMALL, cpu, global_batch=64).shape.micro_batch == 16
