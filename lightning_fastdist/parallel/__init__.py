"""Torch only (no Lightning import here): what is done to a model and to its communication, one folder per concern.

``plan/`` the plan every engine applies (blocks, activation checkpointing, compile, in one order); ``ddp/``, ``fsdp/``,
``deepspeed/`` what each engine adds; ``comm/`` bytes and exposed time, and buffers made rank 0's; ``faults/`` a job
that fails as one; ``checkpoint/`` atomic writes; ``precision/`` fp8 layers and fused optimizers; ``gradients/`` their
norms and which parameters get them; ``across_nodes/`` nodes as torchft replica groups (``outer_sync/``,
``replica_groups/``). Strategies in :mod:`lightning_fastdist.strategies` apply them through one
:class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan`. ``docs/architecture.md`` draws the layers.
"""

import sys

from lightning_fastdist.parallel.precision import fp8

# The path docs/precision.md gave layer_verdicts before the precision folder (one more release).
sys.modules[f"{__name__}.fp8"] = fp8
