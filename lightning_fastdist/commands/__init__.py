"""Subcommands of ``lightning-fastdist`` beyond LightningCLI's fit/validate/test/predict.

Each module here has ``main(argv: list[str]) -> int`` and is listed in
:data:`lightning_fastdist.cli.EXTRA_COMMANDS`.
"""
