"""``UsageError``: a command-line or recipe mistake, found before any process starts.

``args.py`` and ``FastDistCLI`` (``app.py``) raise it; ``main`` (``command.py``) prints its message as one line on
stderr and exits with status 2, instead of a usage dump or a traceback. A class's own check of its arguments is such a
mistake; a bug in the user's own code is not (:func:`raised_in_user_code`): it keeps its traceback.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

# Where the code of installed packages, the standard library and this package lives: an exception raised there is a
# check of the arguments it was given (torch's, Lightning's, ours, a model library's), not a bug of the user's.
_LIBRARY_FOLDERS = tuple(
    {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    | {Path(__file__).resolve().parents[1]}
)


class UsageError(Exception):
    """A command-line mistake, reported as a short message before any process starts."""


def raised_in_user_code(error: BaseException) -> BaseException | None:
    """The exception behind ``error`` (itself, or one it was raised from: jsonargparse wraps what a class raises) that
    a line of the user's own code raised, in a model or data module outside every installed package; ``None`` where
    none was. The user needs its traceback to find that line."""
    seen: BaseException | None = error
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        if frames and not any(Path(frames[-1].filename).resolve().is_relative_to(f) for f in _LIBRARY_FOLDERS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
