"""Size DDP's gradient buckets from the model instead of using one fixed number.

DDP groups gradients into buckets and starts a bucket's all-reduce as soon as
the backward pass has filled it, overlapping communication with the rest of
the backward. Two forces pull against each other:

- Few, big buckets leave most communication exposed: the last bucket can only
  start when the backward is over. A model smaller than DDP's fixed 25 MB
  default gets a single bucket and no overlap at all.
- Many, small buckets pay a fixed launch latency per all-reduce and do not
  reach link bandwidth (below about 1 MB per message on NCCL).

The ``"auto"`` rule therefore aims at :data:`TARGET_BUCKETS` buckets per step,
clamped to ``[MIN_BUCKET_MB, MAX_BUCKET_MB]``: large models get buckets big
enough to run at bandwidth, small ones still get several buckets to overlap.
The first bucket decides when communication can start: over a slow link
(the emulated cluster at 50 Mbit/s, docs/ddp.md) the 3.2 MiB demo model waited
181 ms per step for bf16 gradients with 1 MB buckets and 133 ms with 0.25 MB
ones, which start while more of the backward is left to hide them under; hence
a floor of 0.25 MB (it binds only below 2 MiB of gradients: 8 x 0.25 MB).
"""

from __future__ import annotations

from torch import nn

TARGET_BUCKETS = 8
MIN_BUCKET_MB = 0.25
COMPILED_MIN_BUCKET_MB = 1.0  # torch.distributed's default first bucket (dynamo splits graphs at buckets)
MAX_BUCKET_MB = 100.0
MEBIBYTE = 2**20


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of all gradients ``module`` produces (trainable parameters, each counted once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def auto_bucket_cap_mb(module: nn.Module, compiled: bool = False) -> float:
    """DDP ``bucket_cap_mb`` for ``module``: gradient MB / 8, clamped to [0.25, 100] MB.

    ``compiled``: the model runs under ``torch.compile``, whose DDP graph splitting requires buckets no smaller
    than DDP's 1 MB first bucket (dynamo's ``DDPOptimizer`` asserts it): the floor is then 1 MB.
    """
    floor = max(MIN_BUCKET_MB, COMPILED_MIN_BUCKET_MB) if compiled else MIN_BUCKET_MB
    wanted = gradient_bytes(module) / MEBIBYTE / TARGET_BUCKETS
    return min(max(wanted, floor), MAX_BUCKET_MB)
