"""``lightning-fastdist tune``: measure a recipe's candidate setups and write the fastest (:mod:`.command`)."""
