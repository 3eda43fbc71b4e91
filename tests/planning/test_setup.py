"""``Setup``: the one rule for which setups take ``replica_groups``, and the option read from and written to a
strategy section."""

from __future__ import annotations

import pydoc
from dataclasses import replace

import pytest

from lightning_fastdist.commands.bench.setups import all_setups
from lightning_fastdist.parallel.across_nodes.replica_groups.settings import ReplicaGroups
from lightning_fastdist.planning.setup import Setup
from lightning_fastdist.recipes.recipe import STRATEGY_CLASSES, Recipe

OURS = {name: row for name, row in all_setups().items() if row.strategy_class in STRATEGY_CLASSES.values()}


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_setup_takes_replica_groups_exactly_where_its_strategy_accepts_them(name):
    """The rule the advisor, ``--simulate`` and tune share agrees with the strategies themselves, row by bench row:
    DDP without PowerSGD, FSDP sharded inside a node, never with outer_sync, never DeepSpeed."""
    row = OURS[name]
    setup = Setup.from_strategy(row.strategy_class, row.strategy_args)
    try:
        pydoc.locate(row.strategy_class)(**row.strategy_args, replica_groups={"min_nodes": 1})
    except (TypeError, ValueError):
        accepted = False
    else:
        accepted = True
    assert setup.takes_replica_groups == accepted


def test_replica_groups_are_read_from_a_strategy_section_and_written_back_after_the_setups_own_options():
    strategy = Recipe.read("multi_node_fault_tolerant").trainer["strategy"]
    setup = Setup.from_strategy(strategy["class_path"], strategy["init_args"])
    assert setup.replica_groups == ReplicaGroups(min_nodes=1) and setup.takes_replica_groups
    assert list(setup.strategy_options()) == ["comm_hook", "activation_checkpointing", "replica_groups"]
    assert setup.strategy_options()["replica_groups"] == {"min_nodes": 1}
    fsdp = Setup.from_strategy(STRATEGY_CLASSES["FSDP2"], {"sharding": "zero2", "replica_groups": {"min_nodes": 2}})
    assert list(fsdp.strategy_options())[-1] == "replica_groups"
    assert Setup.from_strategy(fsdp.strategy_class, fsdp.strategy_options()) == fsdp
    # The recipe's option, not a row of bench's or tune's: the names and words stay those of the setup without it.
    assert (setup.name, setup.describe()) == (replace(setup, replica_groups=None).name, "DDP")
