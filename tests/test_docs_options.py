"""Each strategy's options table in docs/ names exactly the options its class takes, and the
PowerSGD defaults a user sees in the signature are the settings' own."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lightning_fastdist import FastDDPStrategy, FastDeepSpeedStrategy, FastFSDPStrategy
from lightning_fastdist.parallel.powersgd import PowerSGDSettings

DOCS = Path(__file__).resolve().parents[1] / "docs"
TABLE_HEADER = "| option | values | what it does |"
# Passed by the Trainer, never written in a recipe; and old spellings, named in their new option's row.
NOT_IN_TABLES = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
DEPRECATED = {"block_modules", "shard_modules"}


def documented_options(page: str) -> set[str]:
    """The backticked names in the first column of the page's options table."""
    lines = (DOCS / page).read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2  # past the header and its --- row
    names: set[str] = set()
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first_cell = line.split("|")[1]
        names.update(re.findall(r"`([a-z_0-9]+)`", first_cell))
    return names


@pytest.mark.parametrize(
    ("page", "strategy"),
    [("ddp.md", FastDDPStrategy), ("fsdp.md", FastFSDPStrategy), ("deepspeed.md", FastDeepSpeedStrategy)],
)
def test_options_table_names_every_option_of_the_class(page, strategy):
    parameters = inspect.signature(strategy.__init__).parameters
    options = {name for name, p in parameters.items() if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert documented_options(page) == options - NOT_IN_TABLES - DEPRECATED


def test_powersgd_defaults_come_from_the_settings():
    parameters = inspect.signature(FastDDPStrategy.__init__).parameters
    defaults = {name.removeprefix("powersgd_"): p.default for name, p in parameters.items() if "powersgd" in name}
    settings = PowerSGDSettings()
    assert defaults == {name: getattr(settings, name) for name in defaults}
    assert defaults["start_iter"] == 1000  # the strategy's documented default, now the only one
