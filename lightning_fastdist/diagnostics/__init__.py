"""Measurement helpers with no Lightning dependency: host-sync counting, memory model, advisor."""

from lightning_fastdist.diagnostics.host_syncs import HostSync, HostSyncCounter, count_host_syncs
from lightning_fastdist.diagnostics.memory_model import MemoryEstimate, TrainingShape, estimate_memory
from lightning_fastdist.diagnostics.peak_flops import peak_flops

__all__ = [
    "HostSync",
    "HostSyncCounter",
    "MemoryEstimate",
    "TrainingShape",
    "count_host_syncs",
    "estimate_memory",
    "peak_flops",
]
