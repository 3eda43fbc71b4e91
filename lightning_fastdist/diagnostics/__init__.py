"""Measurement helpers with no Lightning dependency: host-sync counting, memory model, advisor."""

from lightning_fastdist.diagnostics.host_syncs import HostSync, HostSyncCounter, count_host_syncs  # noqa: E402
from lightning_fastdist.diagnostics.peak_flops import peak_flops  # noqa: E402
from lightning_fastdist.diagnostics.memory_model import MemoryEstimate, TrainingShape, estimate_memory  # noqa: E402
