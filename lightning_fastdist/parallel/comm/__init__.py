"""Communication measured: bytes and collectives per step, and the time a step waits for them (exposed)."""
