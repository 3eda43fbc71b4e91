"""Turn command-line mistakes into one readable message instead of a usage dump.

jsonargparse reports a bad value inside a subclass-typed option (``--model``,
``--data``) as a nested explanation of every Union branch it tried. The user
needs only the branch that names their mistake; :func:`condense_parser_error`
keeps that and drops the rest. Lines it does not recognise are kept, so a
future jsonargparse wording degrades to a longer message, never a lost one.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

# Lines of a jsonargparse Union error that describe the machinery, not the mistake.
_NOISE = (
    re.compile(r"^Does not validate against any of the Union subtypes$"),
    re.compile(r"^Subtypes: \["),
    re.compile(r"^Errors:$"),
    re.compile(r"^Expected a <class 'NoneType'>$"),
    re.compile(r"^Given value type: "),
    re.compile(r"^Given value: (NestedArg|Namespace)\("),
    re.compile(r"^Expected a path but .* either not accessible or invalid$"),
    # A class-typed option (trainer.strategy, trainer.plugins) also tries its plain-string and
    # other-base-class branches.
    re.compile(r"^Expected a <class 'str'>$"),
    re.compile(r"^Given value: [\[{]"),
    re.compile(r"^Not a valid subclass of \w+$"),
    re.compile(r"^Subclass types expect one of:"),
    re.compile(r"^a class path \(str\)$"),
    re.compile(r"^a dict (with|without) (class_path|parameters accepted by the base class)"),
    re.compile(r"^Import path \S+ does not correspond to a subclass of \w+$"),
)
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*')


class UsageError(Exception):
    """A command-line mistake, reported as a short message before any process starts."""


def condense_parser_error(message: str) -> str:
    """Shorten a jsonargparse error to the lines that name the problem.

    ``Parser key "model": ... Option 'n_layr' is not accepted`` becomes
    ``model: Problem with given class_path '...TinyGPT': Option 'n_layr' is not accepted``.
    """
    key_match = _PARSER_KEY.match(message)
    body = message[key_match.end() :] if key_match else message
    kept = []
    for line in body.splitlines():
        text = line.strip().removeprefix("- ").strip()
        if text and not any(pattern.match(text) for pattern in _NOISE):
            kept.append(text)
    condensed = ""
    for text in kept:
        separator = "" if not condensed else (" " if condensed.endswith(":") else "; ")
        condensed += separator + text
    return f"{key_match.group(1)}: {condensed}" if key_match else condensed


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path) -> object:
    """The content of the YAML file ``path``; a key given twice in one mapping is an error."""
    return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def check_yaml_file(flag: str, path: Path) -> None:
    """Raise :class:`UsageError` naming the file, line and column if ``path`` is not a YAML mapping of options."""
    try:
        content = load_yaml(path)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise UsageError(f"{flag}: '{path}' is not valid YAML{where}: {problem}.") from None
    except OSError as error:
        raise UsageError(f"{flag}: cannot read '{path}': {error.strerror}.") from None
    if content is None:
        raise UsageError(
            f"{flag}: '{path}' is empty; a recipe holds a mapping of options (trainer:, model:, data:, ...)."
        )
    if not isinstance(content, dict):
        raise UsageError(
            f"{flag}: '{path}' must hold a mapping of options (trainer:, model:, data:, ...), "
            f"got a {type(content).__name__}."
        )
