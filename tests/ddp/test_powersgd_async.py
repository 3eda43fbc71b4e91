"""PowerSGD's hook returns before its all-reduces complete, with the same gradients and bytes as waiting for each.

Two real gloo ranks. The reference below is the hook as it was before its rounds were chained through
futures: it waits for the P and then the Q all-reduce inside the hook, and draws Q's first values on a
CPU generator, bucket by bucket. Both hooks average the same gradients; they must agree bit for bit, step
for step, with the same bytes, though the hook batches buckets into fewer all-reduces. That the hook returns
before its all-reduces complete is shown without timing anything: rank 1 starts its backward only once rank 0's
hook has returned for every bucket, so none of rank 0's all-reduces can have completed by then.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_fastdist.parallel.comm.accounting import ALL_REDUCE, Traffic
from lightning_fastdist.parallel.ddp import powersgd
from lightning_fastdist.parallel.ddp.comm_hooks import launch_mean_all_reduce
from lightning_fastdist.parallel.ddp.powersgd import (
    BATCHES_PER_STEP,
    PowerSGDSettings,
    PowerSGDState,
    _bucket_views,
    _factor_columns,
    _flatten,
    _orthonormalise_columns,
    _unflatten_into,
    powersgd_hook,
)
from tests.ddp.test_comm_hooks import backward, local_batch, tiny_model
from tests.support.harness import run_function

START_ITER = 2
STEPS = 5


def blocking_powersgd_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """The hook before the change: every round waits in the hook, Q starts from a CPU generator."""
    is_last = bucket.is_last()
    if is_last:
        state.stats.finish_round()
    views = _bucket_views(bucket)
    compress = [_factor_columns(view, state.settings.rank) > 0 for view in views]
    if state.iteration < state.settings.start_iter or not any(compress):
        state.iteration += is_last
        return launch_mean_all_reduce(state, bucket.buffer())
    keys = [state.parameter_index[id(p)] for p, wanted in zip(bucket.parameters(), compress) if wanted]
    matrices = [view.view(view.shape[0], -1) for view, wanted in zip(views, compress) if wanted]
    exact = [view for view, wanted in zip(views, compress) if not wanted]
    exact_average = launch_mean_all_reduce(state, _flatten(exact)) if exact else None
    for key, matrix in zip(keys, matrices):
        if key in state.errors:
            matrix.add_(state.errors[key])
    compensated = [matrix.clone() for matrix in matrices]
    for key, matrix in zip(keys, matrices):
        if key not in state.q_memory:
            generator = torch.Generator().manual_seed(hash((state.settings.seed, key, state.iteration)) % 2**63)
            shape = (matrix.shape[1], min(state.settings.rank, *matrix.shape))
            state.q_memory[key] = torch.randn(shape, generator=generator).to(matrix.device, matrix.dtype)
    qs = [state.q_memory[key] for key in keys]
    ps = [matrix @ q for matrix, q in zip(matrices, qs)]
    _unflatten_into(launch_mean_all_reduce(state, _flatten(ps)).wait(), ps)
    for matrix, q, p in zip(matrices, qs, ps):
        _orthonormalise_columns(p)
        torch.matmul(matrix.t(), p, out=q)
    _unflatten_into(launch_mean_all_reduce(state, _flatten(qs)).wait(), qs)
    for key, matrix, q, p, before in zip(keys, matrices, qs, ps, compensated):
        torch.matmul(p, q.t(), out=matrix)
        state.errors[key] = before.sub_(matrix)
    state.iteration += is_last
    if exact_average is None:
        done = Future()
        done.set_result(bucket.buffer())
        return done
    return exact_average.then(lambda average: _unflatten_into(average.value(), exact) or bucket.buffer())


def compare_with_the_blocking_hook() -> dict:
    settings = PowerSGDSettings(rank=2, start_iter=START_ITER)
    model = tiny_model()
    reference_model = copy.deepcopy(model)
    blocking = DistributedDataParallel(reference_model, bucket_cap_mb=0.01)  # more buckets than batches
    reference = PowerSGDState(settings=settings)
    reference.index_parameters(reference_model)
    blocking.register_comm_hook(reference, blocking_powersgd_hook)

    returned_done: list[bool] = []
    buckets_per_step: list[int] = [0] * STEPS
    # Rank 0 lets rank 1 start its backward once its hook has returned for the last bucket (compressed steps).
    all_hooks_returned = dist.new_group(backend="gloo")

    def recording_hook(hook_state, bucket):  # powersgd_hook, noting whether its future was done when it returned
        buckets_per_step[hook_state.iteration] += 1
        compressed = hook_state.iteration >= START_ITER
        future = powersgd_hook(hook_state, bucket)
        if compressed:
            returned_done.append(future.done())
        if compressed and bucket.is_last() and dist.get_rank() == 0:
            dist.barrier(group=all_hooks_returned)
        return future

    chained = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = PowerSGDState(settings=settings)  # as CommHookSpec("powersgd").register builds it
    state.index_parameters(model)
    # The Q rounds' group, which the hook would create at its first compressed bucket, up front: creating a group
    # waits for every rank, and rank 1 waits for rank 0's hooks (below).
    state.factor_group()
    chained.register_comm_hook(state, recording_hook)

    identical, bytes_chained, bytes_blocking, calls_chained, calls_blocking = [], [], [], [], []
    for step in range(STEPS):
        tokens = local_batch(step)
        before = reference.stats.totals.get(ALL_REDUCE, Traffic())
        backward(blocking, tokens)
        sent = reference.stats.totals[ALL_REDUCE] - before
        bytes_blocking.append(sent.bytes)
        calls_blocking.append(sent.calls)
        if step >= START_ITER and dist.get_rank() == 1:
            dist.barrier(group=all_hooks_returned)  # rank 0's all-reduces cannot finish before rank 1 joins them
        before = state.stats.totals.get(ALL_REDUCE, Traffic())
        backward(chained, tokens)
        sent = state.stats.totals[ALL_REDUCE] - before
        bytes_chained.append(sent.bytes)
        calls_chained.append(sent.calls)
        pairs = zip(model.parameters(), reference_model.parameters())
        identical.append(all(torch.equal(a.grad, b.grad) for a, b in pairs))
    errors_identical = state.errors.keys() == reference.errors.keys() and all(
        torch.equal(state.errors[key], reference.errors[key]) for key in state.errors
    )
    return {
        "identical": identical,
        "errors_identical": errors_identical and bool(state.errors),
        "bytes": (bytes_chained, bytes_blocking),
        "calls": (calls_chained, calls_blocking),
        "buckets_per_step": buckets_per_step,
        "returned_done": returned_done,
        "rounds": (state.stats.rounds, reference.stats.rounds),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_chained_rounds_match_the_blocking_hook_and_return_before_the_all_reduce_completes():
    for rank, result in enumerate(run_function(compare_with_the_blocking_hook, world_size=2)):
        assert result["identical"] == [True] * STEPS, result["identical"]
        assert result["errors_identical"]
        chained, blocking = result["bytes"]
        assert chained == blocking and chained[START_ITER] < chained[0]  # compression ran, same bytes
        assert result["rounds"] == (STEPS, STEPS)
        # Batched: fewer all-reduces than the bucket-by-bucket reference (the exact part, P, Q per bucket), two per
        # batch (the exact part travels with P in fp32), at most BATCHES_PER_STEP batches, more buckets than that.
        chained, blocking = result["calls"]
        buckets = result["buckets_per_step"]
        assert chained[:START_ITER] == blocking[:START_ITER] == buckets[:START_ITER]  # exact: one per bucket
        for step in range(START_ITER, STEPS):  # DDP has rebuilt its buckets (one on the first step)
            assert buckets[step] > BATCHES_PER_STEP, buckets
            assert chained[step] % 2 == 0 and 2 <= chained[step] <= 2 * BATCHES_PER_STEP < blocking[step], result
        assert result["returned_done"] and len(result["returned_done"]) >= STEPS - START_ITER
        if rank == 0:  # rank 1 had not started: every future was still pending when the hook returned
            assert not any(result["returned_done"]), result["returned_done"]


def destroy_the_groups_while_a_callback_still_holds_its_batch() -> str:
    finish = powersgd._BucketBatch._finish

    def finish_then_linger(batch, q_average):  # as a thread descheduled right after waking DDP up
        finish(batch, q_average)
        time.sleep(1.0)

    powersgd._BucketBatch._finish = finish_then_linger  # this rank's process only
    model = tiny_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = PowerSGDState(settings=PowerSGDSettings(rank=2, start_iter=START_ITER))
    state.index_parameters(model)
    ddp.register_comm_hook(state, powersgd_hook)
    for step in range(START_ITER + 1):
        backward(ddp, local_batch(step))
    del ddp, state
    dist.destroy_process_group()  # what a finished training run may do while the last callback lingers
    time.sleep(2.0)
    return "alive"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_callback_that_outlives_the_process_group_does_not_abort_the_process():
    # Once CI's rank died here with "Resource deadlock avoided": the lingering callback held the last reference
    # to the Q rounds' group, which was then freed in that group's own thread.
    assert run_function(destroy_the_groups_while_a_callback_still_holds_its_batch, world_size=2) == ["alive"] * 2


def test_q_starts_from_a_generator_on_the_matrix_device_with_the_cpu_numbers():
    state = PowerSGDState(settings=PowerSGDSettings(rank=2))
    matrix = torch.ones(6, 5)
    q = state.q_factor(3, matrix)
    old = torch.randn((5, 2), generator=torch.Generator().manual_seed(hash((0, 3, 0)) % 2**63))
    assert torch.equal(q, old) and q.device == matrix.device  # on CPU the numbers did not change
    assert state.q_factor(3, matrix) is q  # warm start: remembered
