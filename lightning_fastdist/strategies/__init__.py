"""Lightning strategies that compose :mod:`lightning_fastdist.parallel` in the right order."""
