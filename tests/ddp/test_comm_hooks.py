"""Communication hooks on raw torch DDP over gloo: each averages correctly within its precision, and is counted."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.demo import TinyGPT
from lightning_fastdist.parallel.ddp.buckets import auto_bucket_cap_mb, gradient_bytes
from lightning_fastdist.parallel.ddp.comm_hook_spec import CommHookSpec
from lightning_fastdist.parallel.ddp.powersgd import PowerSGDSettings, PowerSGDState, _factor_columns
from tests.support.harness import run_function

# Relative error of one averaged gradient, by hook: fp16 keeps 11 significant
# bits, bf16 keeps 8 (2**-8 = 0.004), "none" is exact up to fp32 summation order.
TOLERANCE = {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}


def tiny_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(n_layer=2, n_head=2, n_embd=32, block_size=16)


def local_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, 256, (4, 17), generator=generator)


def backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    TinyGPT._loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def exact_average_gradients(reference: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    backward(reference, tokens)
    gradients = [p.grad.clone() for p in reference.parameters()]
    for gradient in gradients:
        dist.all_reduce(gradient)
        gradient /= dist.get_world_size()
    return gradients


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def check_precision_hook(name: str) -> dict:
    model = tiny_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)  # several buckets
    state = CommHookSpec(name).register(ddp)
    worst = 0.0
    for step in range(3):
        tokens = local_batch(step)
        backward(ddp, tokens)
        expected = exact_average_gradients(reference, tokens)
        for parameter, average in zip(model.parameters(), expected):
            worst = max(worst, relative_error(parameter.grad, average))
    return {"worst": worst, "rounds": state.stats.rounds, "bytes": state.stats.total_bytes}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_precision_hooks_average_within_their_precision_and_count_bytes(name):
    results = run_function(check_precision_hook, world_size=2, args=(name,))
    fp32_bytes = 3 * gradient_bytes(tiny_model())
    for result in results:
        assert result["worst"] <= TOLERANCE[name], result
        assert result["rounds"] == 3
        assert result["bytes"] == (fp32_bytes if name == "none" else fp32_bytes // 2)
    if name != "none":
        assert max(r["worst"] for r in results) > 0  # the compressed path really ran


def backward_after_the_peer_left() -> str:
    """Three steps on both ranks, then rank 0 takes another backward and rank 1 leaves while rank 0's all-reduce waits
    for it (its connections close: the all-reduce fails after it started, as when a peer is killed mid-step)."""
    ddp = DistributedDataParallel(tiny_model())
    CommHookSpec("none").register(ddp)
    for step in range(3):  # past DDP's own collectives of its first iterations (its buckets rebuilt)
        backward(ddp, local_batch(step))
    if dist.get_rank() == 1:
        time.sleep(2.0)  # rank 0 is inside its all-reduce by then
        dist.destroy_process_group()
        return "left"
    try:
        backward(ddp, local_batch(3))
    except RuntimeError:
        return "raised"
    return "trained on its own gradients"


@pytest.mark.multiprocess
def test_a_failed_all_reduce_fails_the_backward():
    """The exact hook's all-reduce failing (a lost peer) fails the backward, as DDP's own hook does; it once handed DDP
    the rank's own gradients and the step trained on them."""
    assert run_function(backward_after_the_peer_left, world_size=2) == ["raised", "left"]


def check_powersgd(start_iter: int, steps: int, factor_dtype: str = "fp32") -> dict:
    model = tiny_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    settings = PowerSGDSettings(rank=2, start_iter=start_iter, factor_dtype=factor_dtype)
    state = CommHookSpec("powersgd", settings).register(ddp)
    assert isinstance(state, PowerSGDState)
    parameters = list(model.parameters())
    applied_sum = [torch.zeros_like(p) for p in parameters]
    exact_sum = [torch.zeros_like(p) for p in parameters]
    bytes_per_round = []
    for step in range(steps):
        tokens = local_batch(step)
        before = state.stats.total_bytes
        backward(ddp, tokens)
        bytes_per_round.append(state.stats.total_bytes - before)
        expected = exact_average_gradients(reference, tokens)
        for i, (parameter, average) in enumerate(zip(parameters, expected)):
            if step < start_iter:
                assert relative_error(parameter.grad, average) < 1e-6, "exact before start_iter"
            applied_sum[i] += parameter.grad
            exact_sum[i] += average
    compressed = sorted(state.errors)
    assert compressed, "some matrices were compressed"
    low_rank = all(
        torch.linalg.matrix_rank(parameters[key].grad.reshape(parameters[key].shape[0], -1)).item() <= 2
        for key in compressed
    )
    # Error feedback loses nothing: summed applied updates + mean residual == summed exact averages.
    worst_identity_gap = 0.0
    for i in range(len(parameters)):
        residual = (
            state.errors[i].reshape(parameters[i].shape).clone()
            if i in state.errors
            else torch.zeros_like(parameters[i])
        )
        dist.all_reduce(residual)
        residual /= dist.get_world_size()
        worst_identity_gap = max(worst_identity_gap, relative_error(applied_sum[i] + residual, exact_sum[i]))
    return {"low_rank": low_rank, "gap": worst_identity_gap, "bytes": bytes_per_round, "iteration": state.iteration}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_powersgd_sends_low_rank_updates_and_error_feedback_loses_nothing():
    fp32, fp16 = (run_function(check_powersgd, world_size=2, args=(2, 6, dtype)) for dtype in ("fp32", "fp16"))
    full = gradient_bytes(tiny_model())
    # Averaged exactly, in fp32, whatever the factors travel in: vectors and matrices too small to gain.
    exact = sum(p.numel() * 4 for p in tiny_model().parameters() if not _factor_columns(p, rank=2))
    for result, half in zip(fp32, fp16):
        for run in (result, half):
            assert run["iteration"] == 6
            assert run["low_rank"]
            # Every rank applies the same averaged factors, so the identity holds however they were rounded.
            assert run["gap"] < 1e-4, run["gap"]
            assert run["bytes"][:2] == [full, full]  # exact rounds before start_iter
        assert all(b < 0.5 * full for b in result["bytes"][2:])  # tiny model: small matrices, modest gain
        # fp16 factors: the exact part unchanged, the factors' bytes halved.
        assert [exact + (b - exact) // 2 for b in result["bytes"][2:]] == half["bytes"][2:]


def test_auto_bucket_size_aims_at_eight_buckets_within_bounds():
    assert auto_bucket_cap_mb(torch.nn.Linear(10, 10)) == 0.25  # tiny: the 0.25 MB floor
    with torch.device("meta"):
        mid = torch.nn.Linear(4096, 4096)  # 64 MiB of fp32 gradients
        huge = torch.nn.Linear(65536, 65536)  # 16 GiB
    assert auto_bucket_cap_mb(mid) == pytest.approx(8.0, rel=1e-3)
    assert auto_bucket_cap_mb(huge) == 100.0


def test_unknown_hook_name_lists_the_accepted_ones():
    with pytest.raises(
        ValueError,
        match="comm_hook='fp8' is not supported; accepted values: 'auto', 'none', 'fp16', 'bf16', 'powersgd'",
    ):
        CommHookSpec("fp8")
