"""DeepSpeed's checkpoint files recorded instead of written, for a background save to write.

DeepSpeed's ``engine.save_checkpoint`` writes every file before it returns. Its own writers that do not
(``checkpoint.writer: {decoupled: true}``, ``FastCheckpointEngine``) need the ``async_io`` op, compiled at run time
against libaio (not on a CPU machine without it, nor anywhere we compile nothing), and hand the writing process the
live tensors (no copy: the next step changes what is being written). So the engine's own ``save_checkpoint`` runs as
it is (its files' names, their contents, its collectives), except that each file's state goes to
:class:`RecordedFiles` instead of the disk; the background save copies those states and writes them with DeepSpeed's
own engine (the same bytes). Its small files (``latest``, ``zero_to_fp32.py``) are written in place, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class RecordedFiles:
    """Stands in for a DeepSpeed checkpoint engine (``writer``, the engine's own): each ``save(state, path)`` call is
    kept in ``files`` and nothing is written; everything else (directories, loads, what DeepSpeed asks about the
    engine) is ``writer``'s. Not a subclass of DeepSpeed's class: DeepSpeed is imported only where it is used."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.files: list[tuple[Any, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)

    def create(self, info: Any) -> None:
        """Nothing to prepare: the files are written later."""

    def save(self, state_dict: Any, path: str) -> None:
        self.files.append((state_dict, path))

    def commit(self, info: Any) -> bool:
        """Nothing is written yet: the background save writes, then publishes the whole folder."""
        return True

    def write(self, files: list[tuple[Any, str]]) -> None:
        """Write ``files`` (the recorded states, or their copies) as ``writer`` would have."""
        for state, path in files:
            self.writer.save(state, path)


@contextmanager
def recording_files(engine: Any) -> Iterator[RecordedFiles]:
    """Inside, the DeepSpeed ``engine``'s saves record their files into the yielded :class:`RecordedFiles`."""
    recorded = RecordedFiles(engine.checkpoint_engine)
    engine.checkpoint_engine = recorded
    try:
        yield recorded
    finally:
        engine.checkpoint_engine = recorded.writer
