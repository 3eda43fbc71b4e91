"""``doctor --simulate``: trace one training step of the recipe's own model as rank 0 of a world of N ranks.

For each setup and checkpointing mode the model is built on the meta device, changed as the strategies change it,
materialised as fake tensors and trained for two steps with its own ``training_step``; the second is measured. One
job per module: :mod:`.simulate` (the entry point: which steps to trace, the rows made of them), :mod:`.recipe_run`
(what is taken from the recipe), :mod:`.trace` (one setup's step), :mod:`.workers` (traces in spawned processes),
:mod:`.engine_rows` (DDP, FSDP2 and DeepSpeed rows, offload derived), :mod:`.outer_sync_rows`,
:mod:`.replica_groups_rows`, :mod:`.result` (the rows and their JSON). What each row stands for (DDP's buckets,
DeepSpeed's formula state, offload, ``outer_sync``, ``replica_groups``): docs/doctor.md, "--simulate".
"""
