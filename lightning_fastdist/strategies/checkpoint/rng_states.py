"""A process's random states (torch CPU and CUDA, Python ``random``, NumPy) as checkpoint values.

Loadable with ``torch.load(weights_only=True)``, which refuses NumPy arrays (NumPy's key array travels as a tensor).
A rank saves its own GPU's generator alone and restores it to whatever device it now computes on: Lightning's list by
device index gives a rank the wrong state when the resumed job maps GPUs to ranks differently.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

OWN_CUDA_KEY = "torch.cuda.own_device"  # the state of the generator of the GPU this rank computes on
LEGACY_CUDA_KEY = "torch.cuda"  # Lightning's list, one state per visible GPU (checkpoints written before)


def collect_rng_states() -> dict[str, Any]:
    """This process's random states, in types a weights-only ``torch.load`` reads."""
    states = _collect_rng_states(include_cuda=False)
    if "numpy" in states:
        name, keys, position, has_gauss, cached_gaussian = states["numpy"]
        states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), position, has_gauss, cached_gaussian)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[OWN_CUDA_KEY] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return states


def cuda_state_to_restore(states: dict[str, Any], device_index: int) -> torch.Tensor | None:
    """The CUDA generator state for the device this rank computes on now (``device_index``), or ``None``; a legacy
    checkpoint (Lightning's list) can only be read by index."""
    if OWN_CUDA_KEY in states:
        return states[OWN_CUDA_KEY]
    legacy = states.get(LEGACY_CUDA_KEY) or []
    return legacy[device_index] if device_index < len(legacy) else None


def set_rng_states(states: dict[str, Any]) -> None:
    """Make ``states`` (from :func:`collect_rng_states`) this process's random states; the CUDA state goes to the
    current device (the one Lightning set for this rank), and is ignored where CUDA has not started."""
    states = dict(states)
    if "numpy" in states:
        name, keys, position, has_gauss, cached_gaussian = states["numpy"]
        states["numpy"] = (name, keys.numpy().astype("uint32"), position, has_gauss, cached_gaussian)
    cuda_states = {key: states.pop(key) for key in (OWN_CUDA_KEY, LEGACY_CUDA_KEY) if key in states}
    _set_rng_states(states)
    if cuda_states and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        state = cuda_state_to_restore(cuda_states, device)
        if state is not None:
            torch.cuda.set_rng_state(state, device)
