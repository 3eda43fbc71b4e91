"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order.

Each strategy inherits from its Lightning strategy only and calls the helpers the three share from its own
``@override`` hooks, so one strategy file shows everything it does on each hook: :mod:`.job` (launch, joining, a lost
peer), :mod:`.fault_tolerance` (no torn or non-finite checkpoint), :mod:`.exact_resume` (a bit-for-bit resume),
:mod:`.comm_metrics` (bytes per collective, exposed time). ``tests/project/test_layering.py`` holds the import
direction.
"""

from lightning_fastdist.strategies.ddp import FastDDPStrategy
from lightning_fastdist.strategies.deepspeed import FastDeepSpeedStrategy  # imports deepspeed only when constructed
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy

__all__ = ["FastDDPStrategy", "FastDeepSpeedStrategy", "FastFSDPStrategy"]
