"""Torch only (no Lightning import here): what is done to a model and to its communication, one folder per concern.

``plan/`` the plan every engine applies (blocks, activation checkpointing, compile, in one order); ``ddp/``, ``fsdp/``,
``deepspeed/`` what each engine adds; ``comm/`` bytes and exposed time; ``faults/`` a job that fails as one;
``checkpoint/`` atomic writes. Strategies in :mod:`lightning_fastdist.strategies` apply them through one
:class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan`. ``docs/architecture.md`` draws the layers.
"""
