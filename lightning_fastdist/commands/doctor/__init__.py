"""``lightning-fastdist doctor``: environment, memory plan and a recipe; ``--simulate`` (:mod:`.command`)."""
