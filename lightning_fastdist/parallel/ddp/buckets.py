"""Size DDP's gradient buckets from the model instead of using one fixed number.

Few, big buckets leave most communication exposed (a model under DDP's fixed 25 MB default gets one bucket and no
overlap); many, small ones pay a fixed latency per all-reduce and do not reach bandwidth. ``"auto"`` aims at
:data:`TARGET_BUCKETS` buckets per step, clamped to ``[MIN_BUCKET_MB, MAX_BUCKET_MB]``; the floor is small because
the first bucket decides when communication can start (``docs/ddp.md``, "The bucket rule").
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
    """DDP ``bucket_cap_mb`` for ``module``: gradient MB / :data:`TARGET_BUCKETS`, clamped.

    ``compiled``: under ``torch.compile``, dynamo's ``DDPOptimizer`` asserts buckets no smaller than DDP's first.
    """
    floor = max(MIN_BUCKET_MB, COMPILED_MIN_BUCKET_MB) if compiled else MIN_BUCKET_MB
    wanted = gradient_bytes(module) / MEBIBYTE / TARGET_BUCKETS
    return min(max(wanted, floor), MAX_BUCKET_MB)
