"""The doctor's communication model: the ring arithmetic, precision, accumulation and bad input.

Its byte counts are checked against the strategies' real counters in test_fsdp_sharding.py, test_fast_ddp.py and
(DeepSpeed's stages 1 and 2) test_deepspeed.py.
"""

from __future__ import annotations

import pytest

from lightning_fastdist.planning.comm_model import estimate_comm, root_parameters
from lightning_fastdist.planning.memory_model import TrainingShape


def shape(world_size: int = 8, precision: str = "32-true") -> TrainingShape:
    return TrainingShape(
        1_000_000, layers=4, hidden=128, seq_len=64, micro_batch=2, world_size=world_size, precision=precision
    )


def test_in_fp32_zero2_sends_what_ddp_sends_and_zero3_up_to_half_as_much_again():
    ddp, zero2, zero3 = (estimate_comm(shape(), mode).sent_per_device for mode in ("ddp", "zero2", "zero3"))
    assert ddp == 2 * 7 * 4_000_000 // 8
    assert zero2 == ddp
    root = root_parameters(shape())  # gathered once per micro-batch, the blocks twice
    assert root == (256 + 64) * 128 + 2 * 128
    assert zero3 == 7 * 4 * (2 * 1_000_000 - root + 1_000_000) // 8 < ddp * 3 // 2


def test_mixed_precision_gathers_in_two_bytes_and_reduces_in_four():
    zero3 = estimate_comm(shape(precision="bf16-mixed"), "zero3")
    root = root_parameters(shape())
    assert zero3.by_collective() == {"allgather": 2 * (2 * 1_000_000 - root), "reduce_scatter": 4 * 1_000_000}
    assert estimate_comm(shape(precision="bf16-true"), "ddp").allreduce == 2 * 1_000_000


def test_accumulation_multiplies_only_zero3s_gathers():
    once, four = estimate_comm(shape(), "zero3", 1), estimate_comm(shape(), "zero3", 4)
    assert four.allgather == 4 * once.allgather and four.reduce_scatter == once.reduce_scatter
    for mode in ("ddp", "zero2"):  # zero2 keeps the weights gathered across micro-batches
        assert estimate_comm(shape(), mode, 4) == estimate_comm(shape(), mode, 1)


def test_deepspeed_all_reduces_in_the_weights_dtype_at_stage_1_once_and_at_stage_2_per_micro_batch():
    fp32, bf16 = shape(), shape(precision="bf16-mixed")
    assert estimate_comm(fp32, "ds-zero1", 4).by_collective() == {"allreduce": 4_000_000, "allgather": 4_000_000}
    assert estimate_comm(fp32, "ds-zero2", 4).by_collective() == {"allreduce": 16_000_000, "allgather": 4_000_000}
    assert estimate_comm(bf16, "ds-zero2", 1).by_collective() == {"allreduce": 2_000_000, "allgather": 2_000_000}
    # On a ring an all-reduce sends twice what a reduce-scatter does: DeepSpeed's ZeRO-2 sends 1.5x FSDP's.
    assert estimate_comm(fp32, "ds-zero2").sent_per_device == 3 * estimate_comm(fp32, "zero2").sent_per_device // 2
    zero3 = estimate_comm(bf16, "ds-zero3", 2)  # every weight gathered once per micro-batch and kept for backward
    assert zero3.by_collective() == {"allgather": 2 * 2_000_000, "reduce_scatter": 2 * 2_000_000}
    huge = TrainingShape(3 * 10**9, layers=32, hidden=4096, seq_len=2048, micro_batch=1, world_size=8)
    assert estimate_comm(huge, "ds-zero3").allgather == 4 * (3 * 10**9 + 2 * 10**9)  # 1e9 stay gathered


def test_one_device_communicates_nothing():
    assert estimate_comm(shape(world_size=1), "zero3").sent_per_device == 0
    assert estimate_comm(shape(world_size=1), "ddp").by_collective() == {}


@pytest.mark.parametrize(
    "mode, accumulation, message",
    [
        ("zero4", 1, "mode must be one of ddp, zero2, zero3, ds-zero1, ds-zero2, ds-zero3, got 'zero4'"),
        ("ddp", 0, "accumulation must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_name_the_field(mode, accumulation, message):
    with pytest.raises(ValueError, match=message):
        estimate_comm(shape(), mode, accumulation)
