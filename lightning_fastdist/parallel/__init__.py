"""Torch-only building blocks that change a model in place (no Lightning import here).

Strategies in :mod:`lightning_fastdist.strategies` compose these in a fixed order.
"""
