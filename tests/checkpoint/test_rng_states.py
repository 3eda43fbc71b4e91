"""Random states in checkpoints: a rank's CUDA state follows the rank, not the device index it had."""

from __future__ import annotations

import io
import random

import torch

from lightning_fastdist.strategies.checkpoint.rng_states import (
    LEGACY_CUDA_KEY,
    OWN_CUDA_KEY,
    collect_rng_states,
    cuda_state_to_restore,
    set_rng_states,
)


def fake_cuda_state(seed: int) -> torch.Tensor:
    """A tensor shaped like a CUDA generator state (seed and offset as bytes); only its identity matters here."""
    return torch.tensor([seed] * 16, dtype=torch.uint8)


def test_a_ranks_own_gpu_state_goes_to_whatever_device_it_computes_on_now():
    # Saved by the rank that used cuda:3 of eight visible GPUs; resumed where it sees only its own GPU (cuda:0).
    own = fake_cuda_state(3)
    saved = {OWN_CUDA_KEY: own}
    assert cuda_state_to_restore(saved, device_index=0) is own
    assert cuda_state_to_restore(saved, device_index=5) is own  # or on another index: still the rank's own


def test_lightnings_list_by_device_index_is_read_by_index_for_checkpoints_written_before():
    states = [fake_cuda_state(i) for i in range(8)]
    assert cuda_state_to_restore({LEGACY_CUDA_KEY: states}, device_index=3) is states[3]
    assert cuda_state_to_restore({LEGACY_CUDA_KEY: states[:1]}, device_index=3) is None  # not there: left as is
    assert cuda_state_to_restore({}, device_index=0) is None


def test_cpu_states_round_trip_through_a_weights_only_load():
    torch.manual_seed(7)
    random.seed(7)
    states = collect_rng_states()
    assert OWN_CUDA_KEY not in states and LEGACY_CUDA_KEY not in states  # no CUDA started in this process
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = (torch.rand(3), random.random())
    set_rng_states(loaded)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
