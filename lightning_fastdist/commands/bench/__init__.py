"""``lightning-fastdist bench``: DDP, FSDP and DeepSpeed setups side by side (:mod:`.command`, the flags and the flow).

The rows it compares (:mod:`.setups`, with Lightning's FSDP2 baseline model in :mod:`.baselines`), one setup trained
in fresh processes (:mod:`.setup_run`, which ``tune`` reuses for its trials), the rows' arithmetic and table
(:mod:`.rows`), the plot (:mod:`.plot`); what each run measures (:mod:`.probe` in a fit, :mod:`.hand_loop` for the
hand-written loop, both through :mod:`.measures` and :mod:`.step_profile`).
"""
