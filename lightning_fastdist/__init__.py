"""lightning_fastdist: fast distributed training for PyTorch Lightning by default.

Importing the package registers the strategy names ``fast_ddp``, ``fast_fsdp`` and ``fast_deepspeed``
(DeepSpeed itself is optional: ``pip install lightning-fastdist[deepspeed]``).
"""

from lightning_fastdist.callbacks import (
    BottleneckReport,
    DataLoaderTuner,
    NonFiniteLoss,
    RayReport,
    SpeedMonitor,
    SyncFreeLogging,
)
from lightning_fastdist.commands.to_lightning import to_lightning_checkpoint
from lightning_fastdist.diagnostics.host_syncs import count_host_syncs
from lightning_fastdist.parallel.across_nodes.outer_sync.settings import OuterSync
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.parallel.gradients.grad_norm import grad_norm
from lightning_fastdist.precision import FastMixedPrecision
from lightning_fastdist.strategies import FastDDPStrategy, FastDeepSpeedStrategy, FastFSDPStrategy

__version__ = "0.1.0"

__all__ = [
    "BottleneckReport",
    "DataLoaderTuner",
    "FastDDPStrategy",
    "FastDeepSpeedStrategy",
    "FastFSDPStrategy",
    "FastMixedPrecision",
    "NonFiniteLoss",
    "OuterSync",
    "RayReport",
    "ReplicaGroups",
    "SpeedMonitor",
    "SyncFreeLogging",
    "count_host_syncs",
    "grad_norm",
    "to_lightning_checkpoint",
]
