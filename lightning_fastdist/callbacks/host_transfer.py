"""Move many scalar tensors to the host with one copy per device."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import Tensor


def scalars_to_host(values: Mapping[str, Tensor]) -> dict[str, float | int | bool]:
    """Python numbers for one-element tensors, equal to ``tensor.item()``, read with one batched copy per device.

    Each device's tensors are stacked as float64, which holds every float32 and integer value a metric takes
    exactly. On CUDA the copy is non-blocking into pinned memory and the host waits once, on an event.

    Raises:
        ValueError: a tensor has more than one element.
    """
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = defaultdict(list)
    for name, tensor in values.items():
        if tensor.numel() != 1:
            raise ValueError(f"scalars_to_host: {name!r} has {tensor.numel()} elements; only scalars can be logged.")
        by_device[tensor.device].append((name, tensor))
    host_values: dict[str, float | int | bool] = {}
    for device, items in by_device.items():
        packed = torch.stack([tensor.detach().reshape(()).to(torch.float64) for _, tensor in items])
        if device.type == "cuda":
            staging = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            staging.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(device))
            copied.synchronize()  # the one wait for this device
            packed = staging
        elif device.type != "cpu":
            packed = packed.cpu()
        for (name, tensor), number in zip(items, packed.tolist()):
            if tensor.dtype == torch.bool:
                host_values[name] = bool(number)
            elif tensor.is_floating_point():
                host_values[name] = number
            else:
                host_values[name] = int(number)
    return host_values
