"""The demo corpus: the source files of a fixed list of pure-Python standard-library modules.

Nothing is downloaded or copied into this package; the bytes depend only on the Python version, so a run is
deterministic on a given installation, and a model trained on them writes Python-looking text (a readable demo).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Pure-Python modules present in CPython 3.10 through 3.14 (none is frozen,
# none was removed by PEP 594). Order matters: it fixes the byte order of the corpus.
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "textwrap", "difflib", "calendar", "csv", "fractions", "statistics", "shlex",
    "configparser", "optparse", "gettext", "tokenize", "pprint", "dataclasses", "inspect", "typing",
    "zipfile", "tarfile", "shutil", "subprocess", "threading", "heapq", "bisect", "string",
    "contextlib", "functools", "enum", "ast", "pickle", "locale", "sched", "queue", "copy", "random",
    "glob", "fnmatch", "tempfile", "weakref", "pdb", "cmd", "doctest", "smtplib", "ftplib", "imaplib",
    "mailbox", "poplib", "pydoc", "trace", "traceback", "uuid", "wave", "webbrowser", "zipapp",
    "base64", "quopri", "netrc", "plistlib", "ipaddress", "hmac", "secrets", "selectors", "socket",
    "ssl", "signal",
)  # fmt: skip

# A corpus smaller than this cannot feed a meaningful demo run.
MINIMUM_CORPUS_BYTES = 200_000


def stdlib_source_paths() -> list[Path]:
    """Paths of the source files of :data:`STDLIB_MODULES` that this installation has."""
    origins = [getattr(importlib.util.find_spec(name), "origin", None) for name in STDLIB_MODULES]
    return [Path(origin) for origin in origins if origin and origin.endswith(".py") and Path(origin).is_file()]


def load_corpus(path: str | None = None) -> bytes:
    """Return the training text as bytes.

    Args:
        path: a text file (any bytes) to use instead of the standard library sources.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RuntimeError: this Python ships no readable standard library sources (an embedded or byte-code-only build).
    """
    if path is not None:
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"TextDataModule: corpus_path '{path}' is not a readable file.")
        return file.read_bytes()
    corpus = b"".join(p.read_bytes() for p in stdlib_source_paths())
    if len(corpus) < MINIMUM_CORPUS_BYTES:
        raise RuntimeError(
            f"TextDataModule: this Python installation has only {len(corpus)} bytes of standard-library "
            f"source (need {MINIMUM_CORPUS_BYTES}); set corpus_path to a text file instead."
        )
    return corpus
