"""Torch-only building blocks that change a model in place (no Lightning import here).

Strategies in :mod:`lightning_fastdist.strategies` apply them through one
:class:`~lightning_fastdist.parallel.plan.ParallelPlan`, in the order its module describes.
"""
