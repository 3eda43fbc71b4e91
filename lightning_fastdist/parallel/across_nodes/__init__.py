"""Training across nodes on torchft, each node a replica group with a torch.distributed world of its own
(``docs/fault-tolerance.md``, ``docs/outer-sync.md``).

What both forms share is here: where a node stands in the job, the lighthouse and ``Manager`` (``group.py``), what a
node that rejoins a running job receives from a live one (``rejoin.py``), the torchft private names we read
(``torchft_names.py``). The two forms, one folder each: ``outer_sync/`` (DiLoCo: the link crossed every ``every`` steps)
and ``replica_groups/`` (the gradients averaged across the nodes every step).
"""
