"""Checkpoints on disk: atomic writes that never replace what we did not write, and the problems a load can meet."""
