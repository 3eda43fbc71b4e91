"""Subcommands of ``lightning-fastdist`` beyond LightningCLI's fit/validate/test/predict: each has
``main(argv: list[str]) -> int`` and is listed in ``cli/command.py``'s ``EXTRA_COMMANDS``."""
