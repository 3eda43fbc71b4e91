"""What FSDP2 does to a model: ``fully_shard`` per block and at the root, modules kept in fp32, bytes per step."""
