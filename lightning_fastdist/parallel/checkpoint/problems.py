"""Say in one line what is wrong with a checkpoint that does not load, naming the file.

A truncated file, a missing shard or a YAML file passed as a checkpoint ends deep inside ``torch.load`` or
``torch.distributed.checkpoint`` with a traceback that often does not name the file; this looks at the path itself.
"""

from __future__ import annotations

import traceback
import zipfile
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fastdist.parallel.checkpoint.checkpoint_files import DEEPSPEED_INDEX

SHARDED_METADATA = ".metadata"
# How a file written by torch.save starts: a zip archive (torch >= 1.6) or a raw pickle (protocol 2+).
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"


class UnusableCheckpointError(RuntimeError, ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the path and the problem.

    Also a ``ValueError``: Lightning raises that for a checkpoint folder it cannot read, and a user's
    ``except ValueError`` keeps catching it.
    """


def _first_line(error: BaseException) -> str:
    """The error's type and first line; for an error without a message (a bare ``assert``), where it was raised; for
    ``torch.distributed.checkpoint``'s, which says only which ranks failed, the first rank's own reason."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"{_first_line(cause)} (rank {rank})"
    text = str(error).strip().splitlines()
    if text:
        return f"{type(error).__name__}: {text[0]}"
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return type(error).__name__
    where = Path(frames[-1].filename)
    return f"{type(error).__name__} raised in {where.parent.name}/{where.name}, line {frames[-1].lineno}"


def _file_problem(path: Path) -> str | None:
    with open(path, "rb") as file:
        head = file.read(len(_ZIP_MAGIC))
    if head.startswith(_ZIP_MAGIC):
        # A zip archive ends with its directory: a file cut short (a crash or a full disk during a copy) has none.
        if zipfile.is_zipfile(path):
            return None
        return f"is truncated or damaged ({path.stat().st_size} bytes, not a complete zip archive)"
    if head.startswith(_PICKLE_MAGIC):
        return None
    printable = head.decode("utf-8", errors="replace")
    return f"is not a torch checkpoint (it starts with {printable!r}; a recipe or other text file?)"


def _deepspeed_folder(path: Path) -> tuple[str, str | None]:
    """What the DeepSpeed checkpoint folder ``path`` is (the ZeRO stage its files say wrote it) and what is missing.

    DeepSpeed's ``latest`` names the states folder (the tag); in it, ZeRO-3 writes one model-states file per rank
    (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``), stages 1 and 2 one for all (``mp_rank_00_model_states.pt``).
    """
    tag = (path / DEEPSPEED_INDEX).read_text().strip()
    states = path / tag
    if not states.is_dir():
        return "a DeepSpeed folder", f"names its states folder '{tag}' in {DEEPSPEED_INDEX}, and it is missing"
    if any(states.glob("zero_pp_rank_*_model_states.pt")):
        return "a DeepSpeed folder written at ZeRO stage 3", None
    if any(states.glob("mp_rank_*_model_states.pt")):
        return "a DeepSpeed folder written at ZeRO stage 1 or 2", None
    return "a DeepSpeed folder", f"has no model states in its states folder '{tag}'"


def _sharded_folder_problem(path: Path) -> str | None:
    if not (path / SHARDED_METADATA).is_file():
        return f"has no {SHARDED_METADATA} file: an incomplete sharded save, or not a checkpoint folder"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any failure to read it is the answer
        return f"has an unreadable {SHARDED_METADATA} ({_first_line(error)})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"is missing its shard {name}"
        if shard.stat().st_size < size:
            return f"has a truncated shard {name} ({shard.stat().st_size} of at least {size} bytes)"
    return None


def describe_unloadable(path: str | Path, error: BaseException, expects_folder: bool | None = None) -> str:
    """One line: ``path`` and what is wrong with it, for a load of ``path`` that raised ``error``.

    Args:
        error: what the load raised (its first line is used when the path itself looks fine).
        expects_folder: ``True``: the strategy loads sharded folders only, ``False``: single files only, ``None``: both.
    """
    path = Path(path)
    checkpoint = f"checkpoint '{path}'"
    problem: str | None
    if not path.exists():
        problem = "does not exist"
    elif path.is_dir():
        if expects_folder is False:
            problem = "is a folder, not a checkpoint file"
            if (path / SHARDED_METADATA).is_file():
                problem += " (a sharded checkpoint: load it with FastFSDPStrategy)"
        elif (path / DEEPSPEED_INDEX).is_file():  # DeepSpeed's own layout: no .metadata to look for
            kind, problem = _deepspeed_folder(path)
            checkpoint += f" ({kind})"
        else:
            problem = _sharded_folder_problem(path)
    else:
        problem = _file_problem(path)
    return f"{checkpoint} {problem or 'cannot be loaded: ' + _first_line(error)}."
