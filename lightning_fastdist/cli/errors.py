"""``UsageError``: a command-line or recipe mistake, found before any process starts.

``args.py`` and ``FastDistCLI`` (``app.py``) raise it; ``main`` (``command.py``) prints its message as one line on
stderr and exits with status 2, instead of a usage dump or a traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """A command-line mistake, reported as a short message before any process starts."""
