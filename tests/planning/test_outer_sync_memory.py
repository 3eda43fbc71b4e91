"""What ``outer_sync`` adds on each node's local rank 0, by the formula (a real run's bytes: tests/outer_sync)."""

from __future__ import annotations

import torch

from lightning_fastdist import OuterSync
from lightning_fastdist.planning.outer_sync_memory import OuterSyncMemory, outer_sync_memory
from lightning_fastdist.planning.step_memory import StepMemory


def test_bf16_weights_cross_the_link_as_they_are_and_without_delay_only_the_sync_hook_grows():
    settings = OuterSync(every=4, fragments=2, delay=0, lr=1.0, momentum=0.0, nesterov=False)
    memory = outer_sync_memory(settings, [300, 100], torch.bfloat16)
    # 2-byte weights, bf16 pseudo-gradients: no copy for the link; no momentum; the largest fragment in flight.
    assert memory == OuterSyncMemory(
        global_copy=800, outer_momentum=0, in_flight=600, applying=1200, overlaps_steps=False
    )
    step = StepMemory(params=800, grads=800, optimizer=1600, gathered_peak=0, activations_peak=9000, peak=12_200)
    assert memory.device_peak(step) == 12_200  # the hook, state + applying = 4400, stays under the step's peak
    small_batch = StepMemory(params=800, grads=800, optimizer=1600, gathered_peak=0, activations_peak=100, peak=3300)
    assert memory.device_peak(small_batch) == 3200 + 1200


def test_with_delay_the_pseudo_gradient_in_flight_is_alive_at_the_peak_of_the_steps_it_overlaps():
    memory = outer_sync_memory(OuterSync(every=4, fragments=2, delay=1, dtype="fp32"), [300, 100], torch.float32)
    assert (memory.outer_momentum, memory.in_flight, memory.applying) == (1600, 1200, 2400)  # fp32 link: no copy
    step = StepMemory(params=1600, grads=1600, optimizer=3200, gathered_peak=0, activations_peak=9000, peak=15_400)
    assert memory.device_peak(step) == 1600 + 15_400 + 1200
