"""``blocks: auto`` on models this project did not write: what it picks, and the one line that says so."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_fastdist.parallel.plan.blocks import describe_blocks, find_blocks
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan
from tests.support.model_zoo import MODELS, ResidualBlock


class MLPBlock(nn.Module):
    """A block whose MLP is ``Sequential(Linear, GELU, Linear)``: the Linears repeat, but inside the block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(4))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 10))


@pytest.mark.parametrize(
    ("model_name", "line"),
    [
        ("gpt2", "blocks: GPT2Block x 2 (+ root: wte, wpe, ln_f, lm_head)"),
        ("bert", "blocks: BertLayer x 2 "
                 "(+ root: word_embeddings, position_embeddings, token_type_embeddings, LayerNorm, "),
        ("lightning-transformer", "blocks: TransformerEncoderLayer x 2, TransformerDecoderLayer x 2 "
                                  "(+ root: embedding, norm, decoder)"),
        ("resnet", "blocks: ResidualBlock x 4 (+ root: stem.0, stem.1, head)"),
        ("mlp", "blocks: none in MLPStack (root: net.0, net.2, net.4)"),
    ],
)  # fmt: skip
def test_auto_picks_the_layers_of_each_model(model_name, line):
    model = MODELS[model_name]()
    assert describe_blocks(model, find_blocks(model)).startswith(line)


def test_repeated_leaf_layers_inside_a_block_stay_in_the_block():
    assert find_blocks(Stack()) == [MLPBlock]  # 4 units and the root, not every Linear (the head's included)


def test_a_block_class_holding_another_repeated_class_is_the_outer_one():
    outer = nn.Sequential(*[nn.Sequential(ResidualBlock(4, 4), ResidualBlock(4, 4)) for _ in range(2)])
    assert find_blocks(outer) == [ResidualBlock]  # the stages are containers, never blocks themselves


def test_the_chosen_blocks_are_logged_in_one_line_and_a_model_without_blocks_says_what_happens():
    lines: list[str] = []
    plan = ParallelPlan()
    plan.apply(Stack(), wrapper_uses_blocks=True, log=lines.append)
    plan.apply(MODELS["mlp"](), wrapper_uses_blocks=True, without_blocks="; one unit", log=lines.append)
    plan.apply(Stack(), log=lines.append)  # nothing needs the blocks: nothing resolved, nothing said
    assert lines == [
        "blocks: MLPBlock x 4 (+ root: embedding, head.0, head.1)",
        "blocks: none in MLPStack (root: net.0, net.2, net.4); one unit",
    ]


def test_auto_looks_into_repeated_stacks_of_an_encoder_decoder():
    # T5's encoder and decoder are two T5Stack instances that hold its layers: the layers are the blocks, and the
    # embedding each stack shares with the root stays with the root.
    for model_name, block in [("t5", "T5Block"), ("switch", "SwitchTransformersBlock")]:
        model = MODELS[model_name]()
        assert describe_blocks(model, find_blocks(model)) == (
            f"blocks: {block} x 4 (+ root: shared, embed_tokens, final_layer_norm, lm_head)"
        )


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(8, 4), nn.Linear(8, 4)


class HeadsBlock(nn.Module):
    """A block holding a list of attention heads (one module per head), as in small GPTs written by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(Head() for _ in range(2))
        self.mlp = nn.Linear(8, 8)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HeadsBlock() for _ in range(2))


def test_a_list_inside_a_layer_does_not_make_that_layer_a_stack():
    model = nn.Sequential(HeadsBlock(), HeadsBlock())
    assert find_blocks(model) == [HeadsBlock]  # not one unit per attention head
    twin_towers = nn.ModuleDict({"left": Tower(), "right": Tower()})  # repeated, and holding the layers: stacks
    assert find_blocks(twin_towers) == [HeadsBlock]


class TiedBlock(nn.Module):
    """A block that holds the model's embedding too (tied weights reaching into a block)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding
        self.mlp = MLPBlock()


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.first = TiedBlock(self.wte)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(2))


def test_a_block_sharing_a_parameter_outside_it_stays_in_its_enclosing_unit_and_the_line_names_the_parameter():
    from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding

    model = TiedModel()
    lines: list[str] = []
    ParallelPlan(blocks=["TiedBlock", "MLPBlock"]).apply(model, wrapper_uses_blocks=True, log=lines.append)
    assert lines == [
        "blocks: TiedBlock x 1, MLPBlock x 3 (+ root: wte); kept in the enclosing unit (a parameter shared outside "
        "them): TiedBlock x 1 ('first.embedding.weight' is also 'wte.weight')"
    ]
    units = FSDPSharding().units(model, [TiedBlock, MLPBlock])
    assert model.first not in units and model.first.mlp in units and units[-1] is model  # the MLP inside is one
    assert len(units) == 4  # three MLPBlocks and the root, which holds the embedding and the tied block


def test_named_stacks_that_share_the_embedding_are_kept_with_the_root():
    from lightning_fastdist.parallel.fsdp.sharding import FSDPSharding

    model = MODELS["t5"]()
    lines: list[str] = []
    ParallelPlan(blocks=["T5Stack"]).apply(model, wrapper_uses_blocks=True, log=lines.append)
    assert lines[0].endswith("T5Stack x 2 ('model.encoder.embed_tokens.weight' is also 'model.shared.weight')")
    assert FSDPSharding().units(model, find_blocks(model)) != [model]  # auto: four T5Block units and the root
    assert FSDPSharding().units(model, [type(model.model.encoder)]) == [model]
