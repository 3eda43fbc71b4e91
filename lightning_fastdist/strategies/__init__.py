"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order.

A strategy here is a Lightning strategy class with this package's mixins in front of it, in this
order (``FastFSDPStrategy`` is the fullest example)::

    class FastXStrategy(SharedSetup, FaultTolerance, ExactResume, CommBytesLogging, LightningXStrategy): ...

- :class:`~.shared_setup.SharedSetup`: ``timeout``, the
  :class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan` (blocks, activation checkpointing,
  compile), the recompile watcher, an atomic one-file save, registration. Its docstring says
  which calls the strategy makes, and where.
- :class:`~.fault_tolerance.FaultTolerance`: job identity, preemption, lost peers; route
  ``save_checkpoint`` through ``refuse_non_finite`` and ``load_checkpoint`` through ``load_or_fall_back``.
- :class:`~.exact_resume.ExactResume`: random states and loop progress in every checkpoint; call
  ``_add_resume_state`` in ``save_checkpoint`` and ``_take_resume_state`` in ``load_checkpoint``.
- :class:`~.comm_metrics.CommBytesLogging`: provide ``comm_stats``, ``comm_collectives`` and
  ``log_comm_bytes``; add :class:`~.comm_metrics.GradientRoundPerBackward` before Lightning's class
  when gradients leave from inside ``backward`` (FSDP, DeepSpeed).

What is done to the model lives in :mod:`lightning_fastdist.parallel` (torch only); the strategy
applies ``self.plan`` with its own wrapper where Lightning hands over the model, and ends with
``FastXStrategy.register_once()``. ``tests/project/test_layering.py`` holds the import direction.
"""

from lightning_fastdist.strategies.ddp import FastDDPStrategy
from lightning_fastdist.strategies.deepspeed import FastDeepSpeedStrategy  # imports deepspeed only when constructed
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy

__all__ = ["FastDDPStrategy", "FastDeepSpeedStrategy", "FastFSDPStrategy"]
