"""``bench --profile``: a ``torch.profiler`` record of a few optimizer steps of a row, kept beside its numbers.

The steps profiled come after the timed window and the host-sync count (the profiler slows dispatch), so the row's
numbers do not include it. Two files per row: ``ROW.trace.json.gz`` (a Chrome trace: chrome://tracing or Perfetto)
and ``ROW.ops.txt`` (the operators by self time on the device, or on the CPU without one).
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_fastdist.commands.bench.measures import synchronize

PROFILE_STEPS = 2
TABLE_ROWS = 40


class StepProfile:
    """Profile from :meth:`start` to :meth:`stop`, then write the trace and the table next to ``stem``."""

    def __init__(self, stem: Path, device: torch.device) -> None:
        self.stem = stem
        self.device = device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile = profile(activities=activities)

    def start(self) -> None:
        self._profile.__enter__()

    def stop(self, write: bool = True) -> None:
        """End the record (after the device's work is done); write the files when ``write`` (rank 0)."""
        synchronize(self.device)
        self._profile.__exit__(None, None, None)
        if not write:
            return
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        self.stem.with_name(self.stem.name + ".ops.txt").write_text(table + "\n")
        # torch writes the trace uncompressed: into a temporary folder of our own, so that only the .gz lands beside
        # the stem and no file of that name is overwritten or removed there.
        with tempfile.TemporaryDirectory(prefix="fastdist-trace-") as folder:
            trace = Path(folder, "trace.json")
            self._profile.export_chrome_trace(str(trace))
            packed_path = self.stem.with_name(self.stem.name + ".trace.json.gz")
            with open(trace, "rb") as plain, gzip.open(packed_path, "wb") as packed:
                shutil.copyfileobj(plain, packed)
