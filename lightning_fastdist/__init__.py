"""lightning_fastdist: fast distributed training for PyTorch Lightning by default."""

__version__ = "0.1.0"

from lightning_fastdist.strategies.ddp import FastDDPStrategy  # noqa: E402 - also registers "fast_ddp"
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy  # noqa: E402 - also registers "fast_fsdp"
from lightning_fastdist.callbacks.speed_monitor import SpeedMonitor  # noqa: E402
from lightning_fastdist.callbacks.sync_free_logging import SyncFreeLogging  # noqa: E402
from lightning_fastdist.callbacks.bottleneck_report import BottleneckReport  # noqa: E402
from lightning_fastdist.callbacks.dataloader_tuner import DataLoaderTuner  # noqa: E402
from lightning_fastdist.callbacks.nonfinite_loss import NonFiniteLoss  # noqa: E402
from lightning_fastdist.diagnostics.host_syncs import count_host_syncs  # noqa: E402
from lightning_fastdist.precision import FastMixedPrecision  # noqa: E402
