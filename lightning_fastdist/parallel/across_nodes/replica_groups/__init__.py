"""``replica_groups``: the gradients averaged across nodes every step, a lost node left out and a restarted one taken
back: ``docs/fault-tolerance.md``."""
