"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order.

Each strategy inherits from its Lightning strategy only (``FastDDPStrategy(DDPStrategy)``,
``FastFSDPStrategy(ModelParallelStrategy)``, ``FastDeepSpeedStrategy(DeepSpeedStrategy)``), as Lightning's own
strategies compose their launcher and checkpoint IO: what the three share are helpers that each strategy owns
and calls from its own ``@override`` hooks, so one strategy file shows everything it does on each hook.

- ``ddp.py``, ``fsdp.py``, ``deepspeed.py``: the strategies. Each keeps its collective ``timeout``
  (:func:`~lightning_fastdist.parallel.faults.collective_timeout.collective_timeout`), its
  :class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan` (blocks, activation checkpointing,
  compile), applied where Lightning hands over the model, and a recompile watcher when compiling.
- :mod:`.job`: the launch (class names checked first, a fresh run id), joining the process group, a lost peer
  named; preemption is :class:`~lightning_fastdist.trainer.preemption.PreemptionHandler`.
- :mod:`.fault_tolerance`: no non-finite checkpoint, one file published atomically, an unusable checkpoint
  named (or, for ``last``, the newest that loads).
- :mod:`.exact_resume` (with :mod:`.rng_states` and :mod:`.loop_state`): what a checkpoint needs for a run to
  resume bit for bit.
- :mod:`.comm_metrics`: each optimizer step's bytes per collective and exposed communication time, logged
  without a device sync; a gradient round per backward.
- Options and formats of one strategy: :mod:`.ddp_options`, :mod:`.blocks_option`, :mod:`.comm_hook_checkpoint`
  (DDP's PowerSGD state), :mod:`.deepspeed_checkpoint`; :mod:`.registry` names each strategy for
  ``Trainer(strategy="fast_ddp")``.

``tests/project/test_layering.py`` holds the import direction.
"""

from lightning_fastdist.strategies.ddp import FastDDPStrategy
from lightning_fastdist.strategies.deepspeed import FastDeepSpeedStrategy  # imports deepspeed only when constructed
from lightning_fastdist.strategies.fsdp import FastFSDPStrategy

__all__ = ["FastDDPStrategy", "FastDeepSpeedStrategy", "FastFSDPStrategy"]
