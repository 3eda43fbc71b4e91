"""``lightning-fastdist recipes``: list the packaged recipes and where they are."""

from __future__ import annotations

import argparse

from lightning_fastdist.recipes import available_recipes, recipes_dir


def main(argv: list[str]) -> int:
    """Print the packaged recipe names; ``--path NAME`` prints one recipe's file path instead."""
    parser = argparse.ArgumentParser(prog="lightning-fastdist recipes", description=__doc__)
    parser.add_argument("--path", metavar="NAME", help="print the file path of one packaged recipe")
    args = parser.parse_args(argv)
    if args.path:
        if args.path not in available_recipes():
            parser.error(f"--path: no packaged recipe {args.path!r}; available: {', '.join(available_recipes())}")
        print(recipes_dir() / f"{args.path}.yaml")
        return 0
    print(f"Packaged recipes (in {recipes_dir()}):")
    for name in available_recipes():
        print(f"  {name}")
    print("Use one with: lightning-fastdist fit --config NAME")
    return 0
