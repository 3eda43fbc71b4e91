"""What every strategy does on its hooks (``SharedHooks``), how options are checked, launch and joining, the
Lightning patterns an engine refuses, and what FSDP does to the module it shards."""
