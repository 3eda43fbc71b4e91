"""Peak dense matrix-multiply throughput of common GPUs, for model FLOPs utilisation (MFU).

Dense tensor-core peaks from NVIDIA's datasheets (their sparse figures, marked with an asterisk, halved) and, for the
RTX 4090, the Ada whitepaper (fp16/bf16 with fp32 accumulate). "fp32" is the non-tensor-core peak, what a matmul gets
at ``torch.get_float32_matmul_precision() == "highest"`` (the default); "tf32" applies at "high" or "medium".
"""

from __future__ import annotations

import re

import torch

TERA = 1e12

# name pattern (matched against torch.cuda.get_device_name, most specific first) -> dtype -> TFLOP/s
_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH200 NVL\b", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"\bH200\b", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"\bH100 NVL\b", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"\bH100 PCIe\b", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"\bH100\b", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"\bA100\b", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"\bL40S\b", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"\bRTX 4090\b", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"\bV100\b", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
)

MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp16")


def matmul_dtype(precision: str) -> str:
    """The matmul dtype that a Lightning precision setting (``"bf16-mixed"``, ``"32-true"``, ...) computes in."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one GPU named ``device_name`` in ``dtype``; ``None`` if unknown.

    Args:
        device_name: as ``torch.cuda.get_device_name()`` reports it, e.g. ``"NVIDIA H100 80GB HBM3"``.

    Raises:
        ValueError: ``dtype`` is not one of :data:`MATMUL_DTYPES`.
    """
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"peak_flops: dtype must be one of {MATMUL_DTYPES}, got {dtype!r}.")
    for pattern, table in _PEAK_TFLOPS:
        if re.search(pattern, device_name):
            tflops = table.get(dtype)
            return None if tflops is None else tflops * TERA
    return None
