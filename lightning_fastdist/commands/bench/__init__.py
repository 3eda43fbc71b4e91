"""``lightning-fastdist bench``: DDP, FSDP and DeepSpeed setups side by side (:mod:`.command`)."""
