"""Lightning callbacks: sync-free logging, speed/MFU, bottleneck report, data-loader tuning."""

from lightning_fastdist.callbacks.speed_monitor import SpeedMonitor  # noqa: E402
from lightning_fastdist.callbacks.sync_free_logging import SyncFreeLogging  # noqa: E402
from lightning_fastdist.callbacks.bottleneck_report import BottleneckReport  # noqa: E402
from lightning_fastdist.callbacks.dataloader_tuner import DataLoaderTuner  # noqa: E402
from lightning_fastdist.callbacks.nonfinite_loss import NonFiniteLoss  # noqa: E402
