"""Turn a jsonargparse error (LightningCLI's parser, which reads recipes) into one readable line.

jsonargparse explains a bad ``--model``/``--data`` value through every Union branch it tried; only the branch that
names the mistake is kept. Unrecognised lines are kept too, so a new jsonargparse wording makes a longer message,
never a lost one. The recipe reader (``recipe.py``) and the ``lightning-fastdist`` command (``cli/``) both report
parser errors this way.
"""

from __future__ import annotations

import re

# Lines of a jsonargparse Union error that describe the machinery, not the mistake.
_NOISE = (
    re.compile(r"^Does not validate against any of the Union subtypes$"),
    re.compile(r"^Subtypes: \["),
    re.compile(r"^Errors:$"),
    re.compile(r"^Expected a <class 'NoneType'>$"),
    re.compile(r"^Given value type: "),
    re.compile(r"^Given value: (NestedArg|Namespace)\("),
    re.compile(r"^Expected a path but .* either not accessible or invalid$"),
    # A class-typed option (trainer.strategy, trainer.plugins) also tries its plain-string and other-base branches.
    re.compile(r"^Expected a <class 'str'>$"),
    re.compile(r"^Given value: [\[{]"),
    re.compile(r"^Not a valid subclass of \w+$"),
    re.compile(r"^Subclass types expect one of:"),
    re.compile(r"^a class path \(str\)$"),
    re.compile(r"^a dict (with|without) (class_path|parameters accepted by the base class)"),
    re.compile(r"^Import path \S+ does not correspond to a subclass of \w+$"),
)
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*')


def condense_parser_error(message: str) -> str:
    """Shorten a jsonargparse error to the lines that name the problem.

    ``Parser key "model": ... Option 'n_layr' is not accepted`` becomes
    ``model: Problem with given class_path '...TinyGPT': Option 'n_layr' is not accepted``.
    """
    key_match = _PARSER_KEY.match(message)
    body = message[key_match.end() :] if key_match else message
    condensed = ""
    for line in body.splitlines():
        text = line.strip().removeprefix("- ").strip()
        if text and not any(pattern.match(text) for pattern in _NOISE):
            separator = "" if not condensed else (" " if condensed.endswith(":") else "; ")
            condensed += separator + text
    return f"{key_match.group(1)}: {condensed}" if key_match else condensed
