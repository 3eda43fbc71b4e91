"""``outer_sync``: semi-synchronous data parallelism across nodes (DiLoCo, Streaming DiLoCo) on torchft:
``docs/outer-sync.md``."""
