"""A block class compiled per block that runs at two places (T5's encoder and decoder): the recompile's report says so.

Per-block compile shares one compiled forward between all instances of a block class. Where the same class runs
at two places with inputs of different shapes or arguments, each place needs a graph of its own: an expected
recompile, which the report must not blame on a changing sequence length (and must not ask for ``dynamic``).
"""

from __future__ import annotations

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.plan.blocks import block_modules, call_sites, find_blocks
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan
from tests.support.model_zoo import MODELS

SIZE_CHANGE = (
    "Recompiling function forward in /x/modeling_t5.py:87\n    triggered by the following guard failure(s):\n"
    "    - 0/0: tensor 'args[0]' size mismatch at index 1. expected 16, actual 8"
)


def test_the_places_of_a_block_class_are_its_lists_in_the_model():
    t5 = MODELS["t5"]()
    assert call_sites(t5, block_modules(t5, find_blocks(t5))) == {
        "T5Block": ("model.encoder.block", "model.decoder.block")
    }
    gpt2 = MODELS["gpt2"]()
    assert call_sites(gpt2, block_modules(gpt2, find_blocks(gpt2))) == {}  # one place: nothing to say


def test_the_plan_hands_the_places_of_the_compiled_blocks_on():
    _, prepared = ParallelPlan(compile={"backend": "eager"}).apply(MODELS["t5"]())
    assert prepared.compiled_call_sites == {"T5Block": ("model.encoder.block", "model.decoder.block")}


def test_a_recompile_of_a_block_run_at_two_places_is_reported_as_that_and_later_ones_as_shape_changes():
    lines: list[str] = []
    watcher = RecompileWatcher(report=lines.append)
    watcher.call_sites = {"T5Block": ("model.encoder.block", "model.decoder.block")}
    watcher.record(SIZE_CHANGE)
    assert len(lines) == 1
    assert "T5Block at model.encoder.block, model.decoder.block" in lines[0] and "one compile per place" in lines[0]
    for _ in range(4):  # more recompiles than the places explain: a shape does change between steps
        watcher.record(SIZE_CHANGE)
    assert len(lines) == 2 and "a tensor's shape changed" in lines[1] and "dynamic: true" in lines[1]


def test_without_places_a_size_change_is_a_shape_change():
    lines: list[str] = []
    RecompileWatcher(report=lines.append).record(SIZE_CHANGE)
    assert "a tensor's shape changed" in lines[0]
