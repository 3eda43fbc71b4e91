"""DeepSpeed without Lightning: its settings, its runtime on CPU and GPU, the ZeRO-3 trace, bytes per step."""
