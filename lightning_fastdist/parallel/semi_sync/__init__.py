"""Semi-synchronous data parallelism across nodes (DiLoCo, Streaming DiLoCo) on torchft: ``docs/semi-sync.md``."""
