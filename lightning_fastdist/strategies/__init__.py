"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order.

A room per engine, mirroring ``parallel/``: ``ddp/``, ``fsdp/``, ``deepspeed/``, each holding its strategy (inheriting
from its Lightning strategy only and calling, from its own ``@override`` hooks, the helpers it owns) and the helpers
only it uses. What two or more engines use: ``common/`` (``SharedHooks``, how options are checked, launch and joining,
the patterns an engine refuses), ``checkpoint/`` (no torn or non-finite checkpoint, a bit-for-bit resume),
``across_nodes/`` (one object for training across nodes, whichever form). ``tests/project/test_layering.py`` holds the
import direction, ``tests/project/test_strategy_modules.py`` the shape.
"""

import sys

from lightning_fastdist.strategies.ddp import FastDDPStrategy
from lightning_fastdist.strategies.deepspeed import FastDeepSpeedStrategy, consolidate
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy

# The path docs/deepspeed.md gave consolidate_checkpoint before the engine rooms (one more release).
sys.modules[f"{__name__}.deepspeed_checkpoint"] = consolidate

__all__ = ["FastDDPStrategy", "FastDeepSpeedStrategy", "FastFSDPStrategy"]
