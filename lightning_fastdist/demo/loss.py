"""The language-model loss (the head's matmul and cross-entropy) without the batch's logits in memory.

At the GPT-2-small shape a micro-batch of 16 x 1024 tokens has 0.8 G logits over a 50304-token vocabulary: 1.65 GB
in bf16, and cross-entropy under autocast copies them to fp32 (3.3 GB more) and keeps the copy for the backward.
:func:`chunked_cross_entropy` computes the same mean loss a few thousand rows at a time and, in the same pass, the
gradients of the rows it has just seen (the softmax minus the one-hot target), so no chunk's logits outlive their
chunk and nothing is recomputed in the backward: the FLOPs are those of the plain path. The gradients it keeps
are the size of the head's input and weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Logits per chunk (rows x vocabulary), in fp32: 32 Mi elements, 128 MiB.
CHUNK_LOGITS = 2**25


def compute_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype a matmul on ``tensor`` runs in here: autocast's where autocast is on for its device, else its own."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, targets)`` (mean), its gradients computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype) -> Tensor:
        rows, vocabulary = hidden.shape[0], weight.shape[0]
        chunk = max(1, CHUNK_LOGITS // vocabulary)
        wants_gradients = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):  # the casts below are the whole precision policy
            matrix = weight.to(dtype)
            loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
            grad_hidden = torch.empty_like(hidden) if wants_gradients else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_gradients else None
            for start in range(0, rows, chunk):
                rows_in = hidden[start : start + chunk].to(dtype)
                wanted = targets[start : start + chunk]
                logits = (rows_in @ matrix.t()).float()
                log_normalizer = torch.logsumexp(logits, dim=1)
                loss_sum += (log_normalizer - logits.gather(1, wanted[:, None]).squeeze(1)).sum()
                if wants_gradients:
                    # d(sum of losses)/d(logits) = softmax - one_hot(target), made in place of the logits.
                    grad_logits = logits.sub_(log_normalizer[:, None]).exp_()
                    grad_logits.scatter_add_(1, wanted[:, None], -torch.ones_like(log_normalizer[:, None]))
                    grad_logits = grad_logits.to(dtype)
                    grad_hidden[start : start + chunk] = grad_logits @ matrix
                    grad_weight += (grad_logits.t() @ rows_in).float()
        if wants_gradients:
            ctx.save_for_backward(grad_hidden / rows, (grad_weight / rows).to(weight.dtype))
        return loss_sum / rows

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, never holding them all.

    Args:
        hidden: ``(..., width)``, the head's input (after the final norm).
        weight: ``(vocabulary, width)``, the head's weight (no bias).
        targets: token ids of ``hidden``'s leading shape; every position counts (no ignore index).

    The matmuls run in autocast's dtype where autocast is on (bf16 under ``bf16-mixed``), the softmax in fp32, as
    ``F.cross_entropy`` does under autocast.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), compute_dtype(flat))
