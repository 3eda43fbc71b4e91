"""Measuring a running job: host syncs, recompiles, the communication probe, the data-loader audit, the environment,
peak FLOPs, and the bottleneck checks built on them. What is known before a run lives in
:mod:`lightning_fastdist.planning`."""

from lightning_fastdist.diagnostics.host_syncs import HostSync, HostSyncCounter, count_host_syncs
from lightning_fastdist.diagnostics.peak_flops import peak_flops

__all__ = ["HostSync", "HostSyncCounter", "count_host_syncs", "peak_flops"]
