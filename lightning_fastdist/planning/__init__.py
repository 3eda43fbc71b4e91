"""Before a run: one vocabulary for a setup (``setup.py``), memory and communication models, the advisor behind
``doctor``, and the simulator that traces one step of a recipe's own model at any world size (``simulation/``,
behind ``doctor --simulate``)."""
