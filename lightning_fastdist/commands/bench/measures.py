"""What bench measures the same way for every row, whether a Lightning fit (``probe.py``) or the hand-written loop
(``hand_loop.py``) trains it: peak memory, and model FLOPs utilisation.

MFU is the PaLM / nanoGPT count (the model's ``flops_per_token``: ``6 N + 12 L H Q T`` for TinyGPT, ``N`` without
position embeddings) times tokens per second, over the ranks' dense bf16 peak (``diagnostics/peak_flops.py``; 989
TFLOP/s on an H100 SXM or an H200), whatever the row's precision: one yardstick for fp32, bf16 and fp8 rows alike.
"""

from __future__ import annotations

import resource

import torch

from lightning_fastdist.diagnostics.peak_flops import peak_flops

MFU_PEAK_DTYPE = "bf16"


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); a no-op on the CPU, where work is done when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this rank and what it measures (CUDA allocator peak, or peak process RSS on CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def peak_flops_per_device(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` (``None`` on a CPU or a GPU the table does not know)."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), MFU_PEAK_DTYPE)


def model_flops_utilization(
    tokens_per_s: float | None, flops_per_token: float | None, ranks: int, peak_per_device: float | None
) -> float | None:
    """Achieved model FLOP/s over the ranks' peak; ``None`` when any input is unknown."""
    if not tokens_per_s or not flops_per_token or not peak_per_device:
        return None
    return tokens_per_s * flops_per_token / (ranks * peak_per_device)
