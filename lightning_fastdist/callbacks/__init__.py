"""Lightning callbacks: sync-free logging, speed/MFU, bottleneck report, data-loader tuning, non-finite loss,
checkpoints handed to Ray Train."""

from lightning_fastdist.callbacks.bottleneck_report import BottleneckReport
from lightning_fastdist.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_fastdist.callbacks.nonfinite_loss import NonFiniteLoss
from lightning_fastdist.callbacks.ray_report import RayReport
from lightning_fastdist.callbacks.speed_monitor import SpeedMonitor
from lightning_fastdist.callbacks.sync_free_logging import SyncFreeLogging

__all__ = ["BottleneckReport", "DataLoaderTuner", "NonFiniteLoss", "RayReport", "SpeedMonitor", "SyncFreeLogging"]
