"""Recipe YAML files for ``lightning-fastdist``, shipped inside the package so that ``--config cpu_smoke`` works
from any directory; a path to an existing file always wins."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

RECIPE_SUFFIX = ".yaml"


def recipes_dir() -> Path:
    return Path(str(resources.files(__name__)))


def available_recipes() -> list[str]:
    """Names (without ``.yaml``) of the packaged recipes, sorted."""
    return sorted(p.stem for p in recipes_dir().glob(f"*{RECIPE_SUFFIX}"))


def find_recipe(reference: str) -> Path | None:
    """The file a ``--config`` value names (an existing path, or a packaged recipe as ``NAME``, ``NAME.yaml`` or
    ``recipes/NAME.yaml``), or ``None``."""
    given = Path(reference).expanduser()
    if given.is_file():
        return given
    name = given.name if given.suffix == RECIPE_SUFFIX else given.name + RECIPE_SUFFIX
    packaged = recipes_dir() / name
    if given.parent.name in ("", "recipes") and packaged.is_file():
        return packaged
    return None
