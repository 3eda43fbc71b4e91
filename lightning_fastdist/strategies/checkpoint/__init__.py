"""Checkpoints that are never torn or non-finite and resume bit for bit: random states, files beside a checkpoint,
the comm hook's state."""
