"""PowerSGD gradient compression (Vogels et al., 2019) as a DDP hook that never waits, with checkpointable state.

Each gradient matrix ``M`` travels as two thin averaged factors, ``P = M Q`` then ``Q = M^T P``, and is rebuilt as
``P Q^T``; vectors and matrices too small to gain are averaged exactly. Consecutive buckets are batched because
every all-reduce costs a fixed time (``docs/ddp.md``, Pitfalls).
"""

# No "from __future__ import annotations": DDP compares the hooks' annotations
# with dist.GradBucket and Future[Tensor] at registration, so they must be real objects.

import weakref
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

from lightning_fastdist.parallel.ddp.comm_hooks import HookState, launch_mean_all_reduce

# A matrix is compressed only if its factors are this many times smaller than it.
MIN_COMPRESSION_RATE = 2.0
# Batches of buckets per step, each with one P and one Q all-reduce: a batch per bucket pays each launch's
# fixed cost (docs/bench.md), more than one lets the first ones travel under the rest of the backward.
BATCHES_PER_STEP = 4
# What the P and Q factors may travel in: the names a strategy's signature offers, and their dtypes.
FactorDtypeName = Literal["fp32", "fp16", "bf16"]
POWERSGD_FACTOR_DTYPES = dict(zip(get_args(FactorDtypeName), (torch.float32, torch.float16, torch.bfloat16)))


@dataclass(frozen=True)
class PowerSGDSettings:
    """PowerSGD's options and their one set of defaults (FastDDPStrategy's ``powersgd_*`` options).

    Attributes:
        rank: columns ``r`` of the factors (>= 1); higher is closer to exact and sends more.
        start_iter: optimizer steps averaged exactly first (>= 2): DDP settles its buckets meanwhile, and early
            training is sensitive to compression, so start after the learning-rate warm-up.
        error_feedback: carry each rank's compression error into its next gradient.
        warm_start: reuse last step's ``Q`` factors (a better approximation for free).
        factor_dtype: what ``P`` and ``Q`` are all-reduced in; half precision halves their bytes (bf16 cannot
            overflow, fp16 keeps more mantissa). Products and error feedback stay in the gradients' dtype.
        seed: seed of the random initial ``Q`` (identical on every rank).
    """

    rank: int = 16
    start_iter: int = 1000
    error_feedback: bool = True
    warm_start: bool = True
    factor_dtype: FactorDtypeName = "fp32"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"powersgd_rank must be an integer >= 1, got {self.rank!r}.")
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 2:
            raise ValueError(
                f"powersgd_start_iter must be an integer >= 2, got {self.start_iter!r} "
                "(the first synchronisations are exact while DDP settles its buckets)."
            )
        if self.factor_dtype not in POWERSGD_FACTOR_DTYPES:
            raise ValueError(
                f"powersgd_factor_dtype={self.factor_dtype!r} is not supported; accepted values: "
                f"{', '.join(map(repr, POWERSGD_FACTOR_DTYPES))}."
            )


@dataclass
class PowerSGDState(HookState):
    """The PowerSGD hook's settings and memories on one rank.

    Args:
        iteration: gradient synchronisations so far.
        errors: per parameter, what compression dropped last step (error feedback).
        q_memory: per parameter, the last ``Q`` factor (warm start).
        parameter_index: a parameter's position in the model, by ``id``: the memories' key. Not a DDP bucket
            index: DDP rebuilds its buckets after the first backward, so those differ across a resume.
        batch_elements: elements sent in a batch's first round from which it starts (0: every bucket alone).
    """

    settings: PowerSGDSettings = field(default_factory=PowerSGDSettings)
    iteration: int = 0
    errors: dict[int, Tensor] = field(default_factory=dict)
    q_memory: dict[int, Tensor] = field(default_factory=dict)
    parameter_index: dict[int, int] = field(default_factory=dict)
    batch_elements: int = 0
    last_q_started: Future = field(default_factory=lambda: _done(None), repr=False, compare=False)
    pending: "_BucketBatch | None" = field(default=None, repr=False, compare=False)
    _factor_group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)

    def factor_group(self) -> dist.ProcessGroup | None:
        """The group the Q all-reduces go to, which start from callbacks rather than from DDP's thread.

        NCCL runs a future's callbacks at once in the thread that queued the collective, so the order stays
        DDP's and the group is the hook's. Gloo runs them in its own threads as collectives finish: the Q rounds
        get a group of their own, created on first use in DDP's thread, since creating it from a callback thread
        would race the collectives DDP's thread starts meanwhile on the default group.
        """
        if self._factor_group is None:
            if dist.get_backend(self.process_group) == dist.Backend.NCCL:
                return self.process_group
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self._factor_group = dist.new_group(ranks, use_local_synchronization=True)
        return self._factor_group

    def index_parameters(self, module: nn.Module) -> None:
        """Key the memories by each parameter's position in ``module.parameters()``; size the batches by its shapes."""
        self.parameter_index = {id(p): i for i, p in enumerate(module.parameters())}
        rank = self.settings.rank
        elements = sum(
            _first_round_elements(p, _factor_columns(p, rank)) for p in module.parameters() if p.requires_grad
        )
        self.batch_elements = elements // BATCHES_PER_STEP

    def state_dict(self) -> dict:
        """This rank's position and memories as CPU tensors (error feedback differs per rank)."""
        return {
            "iteration": self.iteration,
            "errors": {key: error.detach().cpu().clone() for key, error in self.errors.items()},
            "q_memory": {key: q.detach().cpu().clone() for key, q in self.q_memory.items()},
        }

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Restore what :meth:`state_dict` returned, moving tensors to ``device``."""
        self.iteration = state["iteration"]
        self.errors = {key: error.to(device) for key, error in state["errors"].items()}
        self.q_memory = {key: q.to(device) for key, q in state["q_memory"].items()}

    def q_factor(self, key: int, matrix: Tensor) -> Tensor:
        """The ``Q`` to multiply ``matrix`` with: the remembered one, or a seeded random one.

        Drawn by a generator on ``matrix``'s device, seeded alike on every rank: the same numbers on
        every rank, and no host-to-device copy (a pageable copy waits for the GPU's queue).
        """
        if key not in self.q_memory or not self.settings.warm_start:
            seed = hash((self.settings.seed, key, self.iteration)) % 2**63
            generator = torch.Generator(device=matrix.device).manual_seed(seed)
            shape = (matrix.shape[1], min(self.settings.rank, *matrix.shape))
            q = torch.randn(shape, generator=generator, device=matrix.device)
            self.q_memory[key] = q.to(matrix.dtype)
        return self.q_memory[key]


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _bucket_views(bucket: dist.GradBucket) -> list[Tensor]:
    """One view into the bucket's flat buffer per parameter, in bucket order, shaped like its gradient."""
    buffer, views, offset = bucket.buffer(), [], 0
    for gradient in bucket.gradients():
        views.append(buffer[offset : offset + gradient.numel()].view(gradient.shape))
        offset += gradient.numel()
    return views


def _factor_columns(gradient: Tensor, rank: int) -> int:
    """Columns of ``gradient``'s factors as a ``rows x rest`` matrix; 0 where it is not compressed."""
    if gradient.dim() < 2:
        return 0
    rows, columns = gradient.shape[0], gradient.numel() // max(gradient.shape[0], 1)
    factor_columns = min(rank, rows, columns)
    return factor_columns if rows * columns > MIN_COMPRESSION_RATE * (rows + columns) * factor_columns else 0


def _first_round_elements(gradient: Tensor, factor_columns: int) -> int:
    """What ``gradient`` sends in a batch's first all-reduce: its ``P`` factor, or itself if not compressed."""
    return gradient.shape[0] * factor_columns if factor_columns else gradient.numel()


def compression_ratio(module: nn.Module, rank: int) -> float:
    """fp32 gradient bytes over the bytes PowerSGD at ``rank`` sends for ``module`` (matrices as P and Q)."""
    total = sent = 0
    for parameter in module.parameters():
        if parameter.requires_grad:
            columns = _factor_columns(parameter, rank)
            total += parameter.numel()
            if columns:  # P and Q; a scalar or an empty matrix is sent as it is
                sent += columns * (parameter.shape[0] + parameter.numel() // parameter.shape[0])
            else:
                sent += parameter.numel()
    return total / sent if sent else 1.0


def _orthonormalise_columns(matrix: Tensor) -> None:
    """Replace ``matrix``'s columns by an orthonormal basis of their span (in place)."""
    matrix.copy_(torch.linalg.qr(matrix.float(), mode="reduced").Q.to(matrix.dtype))


def _flatten(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: Tensor, targets: list[Tensor]) -> None:
    offset = 0
    for target in targets:
        target.copy_(flat[offset : offset + target.numel()].view_as(target))
        offset += target.numel()


def _launch_average(state: PowerSGDState, tensor: Tensor, group: dist.ProcessGroup | None) -> Future:
    """Start an async mean all-reduce of ``tensor`` over ``group`` (bytes counted by the caller); a future of it."""
    tensor.div_(state.world_size)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda _: tensor)


class _BucketBatch:
    """Consecutive buckets' rounds after the hook returned: P averaged -> orthonormalise, ``Q = M^T P`` -> Q
    averaged -> ``M = P Q^T`` and error feedback -> each bucket's future, each a callback of the previous future.

    Collectives must start in the same order on every rank. The hook starts the P all-reduce in DDP's order (the
    exact gradients ride in it when they have the factors' dtype, else in their own all-reduce just before); the
    Q all-reduces start from callbacks, so they go to their own group, in batch order: each waits for the
    previous batch's Q to have started (``previous_q_started``), never for its result.

    A batch holds its state weakly: gloo releases a callback, with what it holds, only after the futures it
    completed woke DDP up, so a held state (and through it a group destroyed meanwhile) could be freed in the
    group's own thread, whose destructor then joins that thread and aborts the process.
    """

    def __init__(self, state: PowerSGDState) -> None:
        self._state = weakref.ref(state)
        self.buffers: list[Tensor] = []
        self.results: list[Future] = []
        self.keys: list[int] = []
        self.matrices: list[Tensor] = []
        self.exact: list[Tensor] = []
        self.first_round_elements = 0
        self.q_started: Future = Future()
        self.exact_average: Future | None = None
        self.exact_with_p = False
        self.compensated: list[Tensor] = []  # the matrices with error feedback added, before compression
        self.ps: list[Tensor] = []
        self.qs: list[Tensor] = []

    @property
    def state(self) -> PowerSGDState:
        state = self._state()
        if state is None:
            raise RuntimeError("The PowerSGD hook's state was released while its buckets were still being averaged.")
        return state

    def add(self, bucket: dist.GradBucket) -> Future:
        """Take ``bucket``'s gradients into the batch; the future DDP waits for, done when the batch is."""
        rank, parameters = self.state.settings.rank, bucket.parameters()
        for view, parameter in zip(_bucket_views(bucket), parameters):
            columns = _factor_columns(view, rank)
            if columns:
                self.keys.append(self.state.parameter_index[id(parameter)])
                self.matrices.append(view.view(view.shape[0], -1))
            else:
                self.exact.append(view)
            self.first_round_elements += _first_round_elements(view, columns)
        self.buffers.append(bucket.buffer())
        device = bucket.buffer().device
        # CUDA-aware on a GPU, so DDP's wait orders its stream after the callbacks' work.
        self.results.append(Future(devices=[device]) if device.type == "cuda" else Future())
        return self.results[-1]

    def start(self, previous_q_started: Future) -> None:
        """Launch the first all-reduce(s) from the hook and chain the rest."""
        state, dtype = self.state, POWERSGD_FACTOR_DTYPES[self.state.settings.factor_dtype]
        if not self.matrices:  # nothing to compress: the exact average alone, and no Q round
            self.q_started.set_result(None)
            launch_mean_all_reduce(state, _flatten(self.exact)).then(self._finish_exact)
            return
        self.exact_with_p = bool(self.exact) and all(view.dtype == dtype for view in self.exact)
        if self.exact and not self.exact_with_p:
            self.exact_average = launch_mean_all_reduce(state, _flatten(self.exact))
        if state.settings.error_feedback:
            for key, matrix in zip(self.keys, self.matrices):
                if key in state.errors:
                    matrix.add_(state.errors[key])
            self.compensated = [matrix.clone() for matrix in self.matrices]
        self.qs = [state.q_factor(key, matrix) for key, matrix in zip(self.keys, self.matrices)]
        self.ps = [matrix @ q for matrix, q in zip(self.matrices, self.qs)]
        sent_p = _flatten(self.ps).to(dtype)
        if self.exact_with_p:
            sent_p = torch.cat([sent_p, _flatten(self.exact)])
        state.stats.record(sent_p)
        # Q's bytes are counted here too, in this thread: a callback thread would race the counters.
        state.stats.record(torch.empty(sum(q.numel() for q in self.qs), dtype=dtype, device="meta"))
        state.factor_group()  # created here, in DDP's thread, never from a callback racing this thread's collectives
        p_average = _launch_average(state, sent_p, state.process_group)
        p_average.then(lambda done: previous_q_started.then(lambda _: self._start_q(done)))

    def _start_q(self, p_average: Future) -> None:
        try:
            self._used_on_this_stream()
            _unflatten_into(p_average.wait(), self.ps + (self.exact if self.exact_with_p else []))
            for matrix, q, p in zip(self.matrices, self.qs, self.ps):
                _orthonormalise_columns(p)
                torch.matmul(matrix.t(), p, out=q)
            sent_q = _flatten(self.qs).to(POWERSGD_FACTOR_DTYPES[self.state.settings.factor_dtype])
            q_average = _launch_average(self.state, sent_q, self.state.factor_group())
        except BaseException as error:  # the buckets' futures carry it to DDP's wait; later batches go on
            self.q_started.set_result(None)
            self._fail(error)
            return
        self.q_started.set_result(None)
        q_average.then(self._finish)

    def _finish(self, q_average: Future) -> None:
        try:
            self._used_on_this_stream()
            _unflatten_into(q_average.wait(), self.qs)
            for matrix, q, p in zip(self.matrices, self.qs, self.ps):
                torch.matmul(p, q.t(), out=matrix)
            if self.state.settings.error_feedback:
                for key, before, after in zip(self.keys, self.compensated, self.matrices):
                    self.state.errors[key] = before.sub_(after)
        except BaseException as error:
            self._fail(error)
            return
        if self.exact_average is None:
            self._succeed()
        else:
            self.exact_average.then(self._finish_exact)

    def _succeed(self) -> None:
        for result, buffer in zip(self.results, self.buffers):
            result.set_result(buffer)

    def _fail(self, error: BaseException) -> None:
        for result in self.results:
            result.set_exception(error)

    def _used_on_this_stream(self) -> None:
        """A callback runs on a side stream: tell the caching allocator that the tensors made on the backward's
        stream are used here too, so their memory is not handed out again before this work ran."""
        if self.buffers[0].is_cuda:
            stream = torch.cuda.current_stream(self.buffers[0].device)
            for tensor in (*self.ps, *self.qs, *self.matrices, *self.compensated):
                tensor.record_stream(stream)

    def _finish_exact(self, exact_average: Future) -> None:
        try:
            _unflatten_into(exact_average.wait(), self.exact)
        except BaseException as error:
            self._fail(error)
            return
        self._succeed()


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Average one bucket with rank-``r`` PowerSGD compression (exact before ``start_iter``).

    Returns at once: the bucket joins the pending batch, whose first all-reduce starts when it holds
    ``state.batch_elements`` or the bucket is the step's last; the rest runs in callbacks (on side streams on a
    GPU), so the backward goes on meanwhile.
    """
    is_last = bucket.is_last()
    if is_last:
        state.stats.finish_round()
    if state.iteration < state.settings.start_iter:
        result = launch_mean_all_reduce(state, bucket.buffer())
    else:
        batch = state.pending or _BucketBatch(state)
        result = batch.add(bucket)
        if is_last or batch.first_round_elements >= state.batch_elements:
            state.pending = None
            batch.start(state.last_q_started)
            state.last_q_started = batch.q_started
        else:
            state.pending = batch
    if is_last:
        state.iteration += 1
    return result
