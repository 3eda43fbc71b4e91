"""TinyGPT: a small decoder-only transformer as a LightningModule.

Deliberately plain, so that a reader can hold it in their head and strategies can find its structure: FSDP,
activation checkpointing and per-block compile act on the ``Block`` instances in the ``ModuleList`` ``TinyGPT.blocks``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchmetrics.text import Perplexity

from lightning_fastdist.demo.loss import chunked_cross_entropy

# The loss of a training step: "full" materialises the logits and calls F.cross_entropy; "chunked" never holds them
# all (lightning_fastdist.demo.loss). Both are computed in forward(idx, targets), inside a whole-model compile.
LOSS_PATHS = ("full", "chunked")
# SDPA kernels by name; "auto" lets torch choose. Which is fastest on a GPU is measured (benchmarks/gpu_bench.py).
ATTENTION_BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only earlier positions.

    Args:
        n_head: must divide ``n_embd``.
        dropout: probability, on the attention weights and the output projection.
        attention: a key of ``ATTENTION_BACKENDS``: the SDPA kernel to pin, or ``"auto"``.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, attention: str = "auto") -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.backend = ATTENTION_BACKENDS[attention]
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_width)
        q, k, v = (t.view(batch, seq_len, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        attention_dropout = self.dropout if self.training else 0.0
        if self.backend is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=attention_dropout, is_causal=True)
        else:
            with sdpa_kernel(self.backend):
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=attention_dropout, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq_len, width)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward layer: widen 4x, GELU, project back, dropout."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(n_embd, 4 * n_embd)
        self.down = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """One pre-norm transformer layer: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, attention: str = "auto") -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, attention)
        self.ln_mlp = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class LinearWarmup:
    """Learning-rate factor for ``LambdaLR``: ``(step + 1) / warmup_steps`` until it reaches 1 (at once for 0).

    A class rather than a lambda so that the scheduler's state is checkpointable.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return 1.0 if step >= self.warmup_steps else (step + 1) / self.warmup_steps


class TinyGPT(LightningModule):
    """A GPT-style language model over bytes, trained with AdamW.

    Logs ``train_loss`` every step, ``val_loss`` and ``val_ppl`` (perplexity)
    per validation run, and ``test_loss``/``test_ppl`` when tested.

    Args:
        vocab_size: 256 covers every byte, which is what ``TextDataModule`` produces.
        block_size: the longest sequence the model accepts (positions embedded).
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream.
        dropout: probability inside the blocks and after the embeddings.
        weight_decay: AdamW's, applied to matrices only (not to biases, norms or position embeddings).
        warmup_steps: optimizer steps over which the learning rate rises linearly from ``learning_rate /
            warmup_steps`` to ``learning_rate`` (0 disables warm-up); it keeps the first steps from spiking.
        max_new_tokens: bytes ``predict_step`` generates after each prompt.
        loss_path: how a training step computes its loss, one of ``LOSS_PATHS``: ``"full"`` (the logits, then
            ``F.cross_entropy``) or ``"chunked"`` (the same mean loss without ever holding the batch's logits:
            ``lightning_fastdist.demo.loss``).
        attention: the SDPA kernel of every block, one of ``ATTENTION_BACKENDS`` (``"auto"``: torch's choice;
            ``"cudnn"`` or ``"flash"`` pin one, e.g. to measure which is faster on a GPU).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 2e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_new_tokens: int = 32,
        loss_path: str = "full",
        attention: str = "auto",
    ) -> None:
        super().__init__()
        for name, value, minimum in (
            ("vocab_size", vocab_size, 1),
            ("block_size", block_size, 1),
            ("n_layer", n_layer, 1),
            ("n_head", n_head, 1),
            ("n_embd", n_embd, 1),
            ("warmup_steps", warmup_steps, 0),
        ):
            if value < minimum:
                raise ValueError(f"TinyGPT: {name} must be >= {minimum}, got {value}.")
        if n_embd % n_head != 0:
            raise ValueError(f"TinyGPT: n_embd ({n_embd}) must be divisible by n_head ({n_head}).")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"TinyGPT: dropout must be in [0, 1), got {dropout}.")
        choices = (("loss_path", loss_path, LOSS_PATHS), ("attention", attention, ATTENTION_BACKENDS))
        for name, value, accepted in choices:
            if value not in accepted:
                raise ValueError(f"TinyGPT: {name} must be one of {', '.join(accepted)}; got {value!r}.")
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, attention) for _ in range(n_layer))
        self.ln_final = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # weight tying, as in GPT-2
        self._init_weights()
        self.val_perplexity = Perplexity()
        self.test_perplexity = Perplexity()

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        residual_std = 0.02 / math.sqrt(2 * self.hparams.n_layer)
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif "ln_" in name:
                nn.init.ones_(parameter)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(parameter, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(parameter, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Next-token logits ``(batch, seq, vocab_size)`` for token ids ``idx``; with ``targets``, the mean loss.

        The loss is computed here rather than in ``training_step`` so that a whole-model compile (``compile_scope:
        model``) covers the head and the cross-entropy too, the largest matmul and tensor of a step at GPT-2's shape.
        """
        seq_len = idx.shape[1]
        if seq_len > self.hparams.block_size:
            raise ValueError(f"TinyGPT: sequence length {seq_len} exceeds block_size {self.hparams.block_size}.")
        positions = torch.arange(seq_len, device=idx.device)
        x = self.embedding_dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x)
        if targets is None:
            return self.lm_head(x)
        if self.hparams.loss_path == "chunked":
            return chunked_cross_entropy(x, self.lm_head.weight, targets)
        return self._loss(self.lm_head(x), targets)

    @staticmethod
    def _loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self(inputs, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs)
        self.log("val_loss", self._loss(logits, targets), prog_bar=True, sync_dist=True)
        self.val_perplexity(logits, targets)
        self.log("val_ppl", self.val_perplexity)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs)
        self.log("test_loss", self._loss(logits, targets), sync_dist=True)
        self.test_perplexity(logits, targets)
        self.log("test_ppl", self.test_perplexity)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Greedily continue each input sequence by ``max_new_tokens`` bytes; returns only the new bytes."""
        inputs, _ = batch
        return self.generate(inputs, self.hparams.max_new_tokens)[:, inputs.shape[1] :]

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int) -> Tensor:
        """Append ``max_new_tokens`` greedily chosen tokens to ``idx`` (context cropped to ``block_size``)."""
        for _ in range(max_new_tokens):
            next_token = self(idx[:, -self.hparams.block_size :])[:, -1].argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, next_token], dim=1)
        return idx

    def configure_optimizers(self) -> dict:
        decay, no_decay = [], []
        for name, parameter in self.named_parameters():
            is_matrix = parameter.dim() >= 2 and name != "position_embedding.weight"
            (decay if is_matrix else no_decay).append(parameter)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(self.hparams.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def num_parameters(self, include_position_embedding: bool = True) -> int:
        """Count distinct parameters (the tied embedding/head weight once)."""
        total = sum(p.numel() for p in self.parameters())
        if not include_position_embedding:
            total -= self.position_embedding.weight.numel()
        return total

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs (forward + backward) per token at full ``block_size``.

        ``6 * N`` for the weight matmuls (2 forward, 4 backward per weight per token; ``N`` counts the tied
        embedding/head once, as the head is a real matmul, and leaves out position embeddings, a lookup) plus
        ``12 * n_layer * n_embd * block_size`` for the attention score and value matmuls (PaLM's appendix B
        estimate, as in nanoGPT's MFU).
        """
        hp = self.hparams
        matmul_params = self.num_parameters(include_position_embedding=False)
        return 6.0 * matmul_params + 12.0 * hp.n_layer * hp.n_embd * hp.block_size
