"""Subcommands of ``lightning-fastdist`` beyond LightningCLI's fit/validate/test/predict.

Each command has ``main(argv: list[str]) -> int`` and is listed in
:data:`lightning_fastdist.cli.EXTRA_COMMANDS`; :mod:`~lightning_fastdist.commands.arguments` holds the flags they
share, :mod:`~lightning_fastdist.commands.written_marks` how they recognise and write their own files.
"""
