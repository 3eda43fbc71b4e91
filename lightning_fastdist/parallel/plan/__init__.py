"""The shared plan every engine applies: which modules are blocks, activation checkpointing, compile, and the
order they go on in (:mod:`.parallel_plan`), plus what a model's shape asks of them (shared parameters, KV caches,
experts that may sit idle)."""
