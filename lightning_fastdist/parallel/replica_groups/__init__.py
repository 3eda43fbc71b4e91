"""Nodes as torchft replica groups: the lighthouse and quorums, who is in the job, a node that comes back, and the
every-step form of training across them (``docs/fault-tolerance.md``); the semi-synchronous form is ``semi_sync``."""
