"""``lightning-fastdist doctor``: environment, memory plan and a recipe (:mod:`.command`, the flags and the flow).

What it plans for (:mod:`.plan_inputs`, with :mod:`.demo_model` without a recipe), what it prints (:mod:`.report`),
what it writes (:mod:`.output`), and ``--simulate``'s table, JSON and tailored recipe (:mod:`.simulate`).
"""
