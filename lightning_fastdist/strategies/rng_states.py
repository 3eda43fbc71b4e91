"""A process's random states (torch CPU and CUDA, Python ``random``, NumPy) as checkpoint values.

Lightning's ``_collect_rng_states``/``_set_rng_states`` read and write them; this
module only makes them loadable with ``torch.load(weights_only=True)`` (torch's
default since 2.6), which refuses NumPy arrays: NumPy's key array travels as a
tensor. The global torch generator also decides DataLoader worker seeds: every
DataLoader iterator draws its workers' base seed from it when it is created.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states


def collect_rng_states() -> dict[str, Any]:
    """This process's random states, in types a weights-only ``torch.load`` reads."""
    states = _collect_rng_states(include_cuda=True)
    if "numpy" in states:
        name, keys, position, has_gauss, cached_gaussian = states["numpy"]
        states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), position, has_gauss, cached_gaussian)
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Make ``states`` (from :func:`collect_rng_states`) this process's random states.

    CUDA states are set for the devices present; on a machine without CUDA they are ignored.
    """
    states = dict(states)
    if "numpy" in states:
        name, keys, position, has_gauss, cached_gaussian = states["numpy"]
        states["numpy"] = (name, keys.numpy().astype("uint32"), position, has_gauss, cached_gaussian)
    cuda_states = states.pop("torch.cuda", [])
    _set_rng_states(states)
    if torch.cuda.is_available():
        for device, state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)
