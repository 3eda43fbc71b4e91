"""The ``lightning-fastdist`` command: LightningCLI whose model and data default to the demo workload.

``--config`` also takes a packaged recipe's name; the other subcommands live in ``commands/``. Mistakes end with
exit status 2 and one message on stderr, so a user sees the mistake rather than a usage dump or a traceback.

One concern per module: ``command.py`` (``main``: the help, the subcommands, the run and its closing lines),
``app.py`` (``FastDistCLI``, the LightningCLI subclass), ``args.py`` (what is done to the arguments before parsing),
``config.py`` (saving the resolved config), ``report.py`` (the lines printed after a run), ``errors.py``
(``UsageError``, a mistake reported in one line), ``quiet.py`` (output that says nothing about the run, hidden). How a
parser error is shortened to one line lives beside the recipe reader (``recipes/parser_errors.py``)."""

from lightning_fastdist.cli.app import FastDistCLI
from lightning_fastdist.cli.command import main
from lightning_fastdist.cli.quiet import QUIET_VARIABLE

__all__ = ["QUIET_VARIABLE", "FastDistCLI", "main"]
