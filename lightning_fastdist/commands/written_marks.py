"""How the commands recognise a file they wrote themselves (the only kind they replace): a recipe by its
first line, a JSON document by its ``written_by`` key, a folder by a mark file inside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml


def first_line_starts_with(path: Path, header: str) -> bool:
    with path.open("rb") as file:
        return file.readline().decode(errors="replace").startswith(header)


def refusal(flag: str, path: Path, example: str, ours: Callable[[Path], bool], writer: str, advice: str) -> str | None:
    """Why ``flag``'s ``path`` is not replaced: it is a folder (give ``example`` inside it), or a file ``writer``
    did not write (``ours`` is false for it; ``advice`` says what to do instead); ``None`` when it may be."""
    if path.is_dir():
        return f"{flag}: {path} is a folder; give a file path such as {path / example}"
    if path.exists() and not ours(path):
        return f"{flag}: {path} exists and was not written by {writer}, so it is kept; {advice}"
    return None


def write_recipe(path: Path, comments: list[str], config: dict) -> None:
    """Write ``config`` as a recipe under its ``comments`` (the first one the writer's mark) and how to run it,
    making the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [*comments, "# Run: lightning-fastdist fit --config THIS_FILE"]
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False))


def write_json(path: Path, document: dict) -> None:
    """Write ``document`` (carrying its ``written_by``) as indented JSON, making the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def json_written_by(path: Path) -> str | None:
    """The ``written_by`` of the JSON object at ``path``, or ``None`` (not JSON, not an object, no such key)."""
    try:
        document = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    return document.get("written_by") if isinstance(document, dict) else None


def folder_mark(command: str) -> str:
    """The name of the file that says a folder was written by ``command`` (``bench``, ``tune``)."""
    return f".written-by-lightning-fastdist-{command}"


def folder_refusal(flag: str, folder: Path, command: str) -> str | None:
    """Why ``command`` may not write into ``folder`` (``flag`` names it): a file there, or a folder that holds files
    ``command`` did not write (no mark); ``None`` for a new or empty folder, or one ``command`` claimed."""
    if folder.exists() and not folder.is_dir():
        return f"{flag}: {folder} is a file; give a folder"
    if folder.is_dir() and any(folder.iterdir()) and not (folder / folder_mark(command)).exists():
        return f"{flag}: {folder} holds files {command} did not write; give a new or empty folder"
    return None


def claim_folder(folder: Path, command: str) -> None:
    """Create ``folder`` (checked by :func:`folder_refusal`) and mark it as ``command``'s."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / folder_mark(command)).write_text(
        f"This folder was written by lightning-fastdist {command}; it may replace what is in it.\n"
    )
