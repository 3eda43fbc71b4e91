"""Recipe YAML files for ``lightning-fastdist``, shipped inside the package.

``lightning-fastdist fit --config cpu_smoke`` (or ``cpu_smoke.yaml``, or
``recipes/cpu_smoke.yaml``) finds a packaged recipe from any directory; a path
to an existing file always wins. :mod:`~lightning_fastdist.recipes.recipe` reads one.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

RECIPE_SUFFIX = ".yaml"


def recipes_dir() -> Path:
    """The directory holding the packaged recipe files."""
    return Path(str(resources.files(__name__)))


def available_recipes() -> list[str]:
    """Names (without ``.yaml``) of the packaged recipes, sorted."""
    return sorted(p.stem for p in recipes_dir().glob(f"*{RECIPE_SUFFIX}"))


def find_recipe(reference: str) -> Path | None:
    """Resolve a ``--config`` value to a file, or ``None`` if nothing matches.

    Args:
        reference: a path to an existing file, or a packaged recipe named as
            ``NAME``, ``NAME.yaml`` or ``recipes/NAME.yaml``.
    """
    given = Path(reference).expanduser()
    if given.is_file():
        return given
    name = given.name if given.suffix == RECIPE_SUFFIX else given.name + RECIPE_SUFFIX
    packaged = recipes_dir() / name
    if given.parent.name in ("", "recipes") and packaged.is_file():
        return packaged
    return None
