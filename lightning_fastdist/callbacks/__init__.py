"""Lightning callbacks: sync-free logging, speed/MFU, bottleneck report, data-loader tuning."""
