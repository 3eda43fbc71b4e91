"""Checkpoints of every engine that are never torn or non-finite and resume bit for bit: random states, files beside
a checkpoint, the fall-back to the newest that loads."""
