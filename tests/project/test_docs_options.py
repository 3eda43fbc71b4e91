"""Each strategy's options table in docs/ names exactly the options its class takes, the options every
strategy shares are described once (ParallelPlan's docstring, which docs/plan.md repeats word for word and
the strategy pages point to), and the PowerSGD defaults a user sees in the signature are the settings' own."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from lightning_fastdist import FastDDPStrategy, FastDeepSpeedStrategy, FastFSDPStrategy
from lightning_fastdist.parallel.ddp.powersgd import PowerSGDSettings
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan

DOCS = Path(__file__).resolve().parents[2] / "docs"
TABLE_HEADER = "| option | values | what it does |"
# Passed by the Trainer, never written in a recipe; and old spellings, named in their new option's row.
NOT_IN_TABLES = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
DEPRECATED = {"block_modules", "shard_modules"}


PLAN_OPTIONS = {field.name for field in dataclasses.fields(ParallelPlan) if field.init}
STRATEGY_PAGES = [("ddp.md", FastDDPStrategy), ("fsdp.md", FastFSDPStrategy), ("deepspeed.md", FastDeepSpeedStrategy)]


def table_rows(page: str) -> list[tuple[set[str], str, str]]:
    """Each row of the page's options table: the backticked names of its first cell, its values, its text."""
    lines = (DOCS / page).read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2  # past the header and its --- row
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names, values, text = (cell.strip() for cell in line.split("|")[1:4])
        rows.append((set(re.findall(r"`([a-z_0-9]+)`", names)), values, text))
    return rows


def documented_options(page: str) -> set[str]:
    """The backticked names in the first column of the page's options table."""
    return {name for names, _, _ in table_rows(page) for name in names}


def docstring_arguments(cls: type) -> dict[str, str]:
    """``name: text`` of the Args section of ``cls``'s docstring, as markdown (``x`` and :role:`~a.b.x` -> `x`)."""
    args = inspect.getdoc(cls).split("Args:\n", 1)[1]
    described: dict[str, str] = {}
    for name, text in re.findall(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", args, flags=re.M | re.S):
        text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", " ".join(text.split()))
        described[name] = re.sub(r"``([^`]+)``", r"`\1`", text).replace('`"', "`").replace('"`', "`")
    return described


@pytest.mark.parametrize(("page", "strategy"), STRATEGY_PAGES)
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


@pytest.mark.parametrize(("page", "strategy"), STRATEGY_PAGES)
def test_strategy_pages_point_to_the_one_description_of_the_shared_options(page, strategy):
    for names, values, _ in table_rows(page):
        if names & PLAN_OPTIONS:
            assert values == "[plan.md](plan.md)", f"{page}: {sorted(names)} are described in plan.md only"


def test_plan_page_repeats_the_plans_docstring_word_for_word():
    described = docstring_arguments(ParallelPlan)
    assert set(described) == PLAN_OPTIONS
    rows = {next(iter(names)): text for names, _, text in table_rows("plan.md")}
    assert rows == described
