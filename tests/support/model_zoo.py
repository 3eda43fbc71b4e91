"""Models this project did not write, as users bring them: tiny, seeded, built from random configs (no download).

Each LightningModule reaches its model another way, as real code does:

- :class:`HFCausalLM` / :class:`HFMaskedLM`: HuggingFace ``GPT2LMHeadModel`` / ``BertForMaskedLM``,
  wrapped the HuggingFace way (``self.model(input_ids=..., labels=...)`` in ``training_step``);
- :class:`HFSeq2Seq` / :class:`HFSwitch`: HuggingFace ``T5ForConditionalGeneration`` (encoder and decoder
  stacks of ``T5Block``, embeddings tied into both stacks) and ``SwitchTransformersForConditionalGeneration``
  (the same, with mixture-of-experts layers whose idle experts get no gradient), called
  ``self.model(**batch)`` with a dict batch of ``input_ids``, ``attention_mask`` and ``labels``;
- :class:`DemoTransformer`: Lightning's own ``lightning.pytorch.demos.Transformer`` (encoder and
  decoder layers: two block classes), called as ``self(...)``;
- :class:`ResidualCNN`: a residual CNN in plain torch with BatchNorm, whose ``training_step`` calls
  its stem, stages and head one by one;
- :class:`MLPStack`: an ``nn.Sequential`` of ``Linear``/``ReLU`` (no blocks), called as ``self.net(...)``.

Dropout is off so that every strategy computes the same function; each model's ``batches()`` gives its data.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: every model here is built from a config

VOCAB = 64
SEQUENCE = 16
SAMPLES = 64


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(seed))


class ZooModule(L.LightningModule):
    """What every model here shares: AdamW, a logged loss, seeded construction."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _logged(self, loss: torch.Tensor) -> torch.Tensor:
        self.log("train_loss", loss)
        return loss

    def batches(self, batch_size: int = 4) -> DataLoader:
        raise NotImplementedError


class HFCausalLM(ZooModule):
    """GPT-2 from a tiny random config (2 layers, width 32)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415 - the test extra

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self._logged(self.model(input_ids=tokens, labels=tokens).loss)

    def batches(self, batch_size: int = 4) -> DataLoader:
        return DataLoader(TensorDataset(_tokens()), batch_size=batch_size)


class HFMaskedLM(ZooModule):
    """BERT for masked language modelling from a tiny random config (2 layers, width 32)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM  # noqa: PLC0415 - the test extra

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=SEQUENCE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.model = BertForMaskedLM(config)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return self._logged(self.model(input_ids=tokens, labels=labels).loss)

    def batches(self, batch_size: int = 4) -> DataLoader:
        tokens = _tokens()
        masked = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1)) < 0.25
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        return DataLoader(
            TensorDataset(torch.where(masked, torch.zeros_like(tokens), tokens), labels), batch_size=batch_size
        )


def _seq2seq_batches(batch_size: int) -> DataLoader:
    """Dicts of ``input_ids`` and ``attention_mask`` (16 source tokens) and ``labels`` (8 target tokens)."""
    source, target = _tokens(), _tokens(seed=1)[:, : SEQUENCE // 2]
    samples = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        for ids, labels in zip(source, target)
    ]
    return DataLoader(samples, batch_size=batch_size)


class _EncoderDecoder(ZooModule):
    """A HuggingFace encoder-decoder in ``self.model``, trained ``self.model(**batch)`` on dict batches."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._logged(self.model(**batch).loss)

    def batches(self, batch_size: int = 4) -> DataLoader:
        return _seq2seq_batches(batch_size)


class HFSeq2Seq(_EncoderDecoder):
    """T5 from a tiny random config (2 encoder and 2 decoder layers, width 32), trained ``self.model(**batch)``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration  # noqa: PLC0415 - the test extra

        config = T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        self.model = T5ForConditionalGeneration(config)


class HFSwitch(_EncoderDecoder):
    """SwitchTransformers from a tiny random config: 2 + 2 layers, every second one a mixture of 16 experts
    (one module per expert, top-1 routing: an expert that no token of a rank's batch reaches has no gradient
    there, and which experts those are differs between ranks). No router noise: every run draws the same.
    """

    def __init__(self) -> None:
        super().__init__()
        from transformers import (  # noqa: PLC0415 - the test extra
            SwitchTransformersConfig,
            SwitchTransformersForConditionalGeneration,
        )

        config = SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, expert_capacity=64, num_layers=2, num_decoder_layers=2,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=4, num_experts=16, dropout_rate=0.0,
            router_jitter_noise=0.0,
            decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        self.model = SwitchTransformersForConditionalGeneration(config)


class DemoTransformer(ZooModule):
    """Lightning's demo ``Transformer`` (nn.Transformer: 2 encoder and 2 decoder layers, width 16)."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer  # noqa: PLC0415

        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        inputs, target = tokens[:, :-1], tokens[:, 1:]
        return self._logged(F.nll_loss(self(inputs, target), target.reshape(-1)))

    def batches(self, batch_size: int = 4) -> DataLoader:
        return DataLoader(TensorDataset(_tokens()), batch_size=batch_size)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip connection.

    Strided, with a 1x1 projection, when it downsamples.
    """

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResidualCNN(ZooModule):
    """A small ResNet (stem, two stages of two blocks, head) for 10 classes of 3x16x16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.stages = nn.Sequential(
            nn.Sequential(ResidualBlock(8, 8), ResidualBlock(8, 8)),
            nn.Sequential(ResidualBlock(8, 16, stride=2), ResidualBlock(16, 16)),
        )
        self.head = nn.Linear(16, 10)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        features = self.stages(self.stem(images)).mean(dim=(2, 3))
        return self._logged(F.cross_entropy(self.head(features), labels))

    def batches(self, batch_size: int = 4) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(SAMPLES, 3, 16, 16, generator=generator)
        return DataLoader(
            TensorDataset(images, torch.randint(0, 10, (SAMPLES,), generator=generator)), batch_size=batch_size
        )


class MLPStack(ZooModule):
    """``nn.Sequential(Linear, ReLU, Linear, ReLU, Linear)``: no block that ``auto`` could name."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self._logged(F.mse_loss(self.net(inputs), targets))

    def batches(self, batch_size: int = 4) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(SAMPLES, 16, generator=generator)
        return DataLoader(TensorDataset(inputs, torch.randn(SAMPLES, 4, generator=generator)), batch_size=batch_size)


MODELS: dict[str, type[ZooModule]] = {
    "gpt2": HFCausalLM,
    "bert": HFMaskedLM,
    "t5": HFSeq2Seq,
    "switch": HFSwitch,
    "lightning-transformer": DemoTransformer,
    "resnet": ResidualCNN,
    "mlp": MLPStack,
}


class HFLlama(L.LightningModule):
    """A HuggingFace Llama decoder from a config given as arguments (tiny in tests, 7B for the planner's scale test).

    Trained the HuggingFace way, ``self.model(input_ids=..., labels=...).loss``, with AdamW; built from its
    config, never downloaded.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB,
        hidden_size: int = 32,
        intermediate_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = SEQUENCE,
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - the test extra

        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class RandomTokens(L.LightningDataModule):
    """Seeded random token ids, ``batch_size`` sequences of ``seq_len`` per batch."""

    def __init__(self, vocab_size: int = VOCAB, seq_len: int = SEQUENCE, batch_size: int = 4, samples: int = 8) -> None:
        super().__init__()
        self.vocab_size, self.seq_len, self.batch_size, self.samples = vocab_size, seq_len, batch_size, samples

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (self.samples, self.seq_len), generator=generator)
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size)
