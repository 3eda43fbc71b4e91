"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order.

Each strategy inherits from its Lightning strategy only and calls, from its own ``@override`` hooks, the helpers it
owns, so one strategy file shows everything it does on each hook: ``common/`` (what every strategy does on its hooks,
``SharedHooks``; how options are checked; the patterns an engine refuses), ``checkpoint/`` (no torn or non-finite
checkpoint, a bit-for-bit resume), ``across_nodes/`` (one object for training across nodes, whichever form).
``tests/project/test_layering.py`` holds the import direction, ``tests/project/test_strategy_modules.py`` the shape.
"""

from lightning_fastdist.strategies.ddp import FastDDPStrategy
from lightning_fastdist.strategies.deepspeed import FastDeepSpeedStrategy  # imports deepspeed only when constructed
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy

__all__ = ["FastDDPStrategy", "FastDeepSpeedStrategy", "FastFSDPStrategy"]
