"""The demo TinyGPT sized to a parameter count: the model ``doctor`` plans for without ``--config``.

GPT-like proportions (hidden about 64 x layers; heads 16 wide, GPT-2's 64 from 256 wide), so that ``--params 1.3B``
gives a shape that the memory formula and the recipe written agree on.
"""

from __future__ import annotations

import math

from lightning_fastdist.recipes.recipe import DEFAULT_DATA, DEFAULT_MODEL

DEMO_VOCAB = 256
SMALL_HEAD_WIDTH = 16
LARGE_HEAD_WIDTH = 64
LARGE_MODEL_WIDTH = 256
DEFAULT_PARAMETERS = 836_352  # the demo TinyGPT's default size


def _demo_parameters(layers: int, hidden: int, seq_len: int) -> int:
    """TinyGPT's parameter count: 12 L h^2 + 13 L h per block, tied embedding/head, positions, final norm."""
    return 12 * layers * hidden**2 + (13 * layers + DEMO_VOCAB + seq_len + 2) * hidden


def demo_model_shape(
    parameters: int, seq_len: int, layers: int | None = None, hidden: int | None = None
) -> tuple[int, int, int]:
    """``(layers, hidden, heads)`` of a demo TinyGPT with about ``parameters`` parameters.

    Heads are 16 wide below 256 and 64 wide from there (GPT-2's head width); ``hidden`` is the
    multiple of the head width whose parameter count is closest to ``parameters``.
    """
    if layers is None:
        # GPT-like aspect ratio: hidden ~ 64 x layers, with 12 x layers x hidden^2 parameters in the blocks.
        layers = max(1, round((parameters / (12 * 64**2)) ** (1 / 3)))
    if hidden is None:
        a, b = 12 * layers, 13 * layers + DEMO_VOCAB + seq_len + 2
        width = (-b + math.sqrt(b * b + 4 * a * parameters)) / (2 * a)
        step = SMALL_HEAD_WIDTH if width < LARGE_MODEL_WIDTH else LARGE_HEAD_WIDTH
        candidates = {max(step, step * math.floor(width / step)), step * math.ceil(width / step)}
        hidden = min(candidates, key=lambda h: abs(_demo_parameters(layers, h, seq_len) - parameters))
    head_width = SMALL_HEAD_WIDTH if hidden < LARGE_MODEL_WIDTH or hidden % LARGE_HEAD_WIDTH else LARGE_HEAD_WIDTH
    return layers, hidden, max(1, hidden // head_width) if hidden % head_width == 0 else 1


def demo_sections(seq_len: int, layers: int, hidden: int, heads: int) -> tuple[dict, dict]:
    """The ``model:`` and ``data:`` sections of a recipe that trains the demo TinyGPT of this shape."""
    model_section = {
        "class_path": DEFAULT_MODEL,
        "init_args": {"n_layer": layers, "n_embd": hidden, "n_head": heads, "block_size": seq_len},
    }
    return model_section, {"class_path": DEFAULT_DATA, "init_args": {"block_size": seq_len}}
