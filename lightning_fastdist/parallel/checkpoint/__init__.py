"""Checkpoints on disk: atomic, durable writes that never replace what we did not write, published with the files
beside them as one unit, a failed save failing on every rank alike, one run per folder, and the ranks agreeing on the
checkpoint they resume from; the problems a load can meet."""
