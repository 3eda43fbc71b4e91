"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019) as a DDP hook, with checkpointable state.

Each gradient matrix ``M`` (``n x m``) is sent as two thin factors instead of
``n * m`` numbers: ``P = M Q`` (``n x r``) is averaged over ranks and
orthonormalised, then ``Q = M^T P`` (``m x r``) is averaged, and every rank
rebuilds ``M ~ P Q^T``. Vectors (biases, norms) and matrices too small to gain
are averaged exactly. With error feedback, what compression dropped on a rank
is added to that rank's next gradient, so nothing is lost over time; with warm
start, ``Q`` carries over between steps so one power iteration per step tracks
the top singular directions.

The error and ``Q`` memories are kept per parameter (by its position in the
model's parameter list), not per DDP bucket: DDP rebuilds its buckets after the
first backward of every process, so bucket indices are not stable across a
resume, while parameter positions are.
"""

# No "from __future__ import annotations": DDP compares the hooks' annotations
# with dist.GradBucket and Future[Tensor] at registration, so they must be real objects.

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

from lightning_fastdist.parallel.comm_hooks import HookState, launch_mean_all_reduce

# A matrix is compressed only if its factors are this many times smaller than it.
MIN_COMPRESSION_RATE = 2.0
# What the P and Q factors may travel in: the names a strategy's signature offers, and their dtypes.
FactorDtypeName = Literal["fp32", "fp16", "bf16"]
POWERSGD_FACTOR_DTYPES = dict(zip(get_args(FactorDtypeName), (torch.float32, torch.float16, torch.bfloat16)))


@dataclass(frozen=True)
class PowerSGDSettings:
    """PowerSGD's options and their one set of defaults (FastDDPStrategy's ``powersgd_*`` options).

    Attributes:
        rank: columns ``r`` of the factors (>= 1); higher is closer to exact and sends more.
        start_iter: optimizer steps averaged exactly before compression starts (>= 2): the first
            synchronisations are exact while DDP settles its buckets, and early training is
            sensitive to compression, so start after the learning-rate warm-up.
        error_feedback: carry each rank's compression error into its next gradient.
        warm_start: reuse last step's ``Q`` factors (a better approximation for free).
        factor_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``: what ``P`` and ``Q`` are all-reduced
            in; half precision halves their bytes (bf16 cannot overflow, fp16 keeps more
            mantissa). The products, orthonormalisation and error feedback stay in the gradients' dtype.
        seed: seed of the random initial ``Q`` (identical on every rank).
    """

    rank: int = 2
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
        settings: the options (:class:`PowerSGDSettings`).
        iteration: gradient synchronisations so far.
        errors: per parameter, what compression dropped last step (error feedback).
        q_memory: per parameter, the last ``Q`` factor (warm start).
        parameter_index: a parameter's position in the model, by ``id``: the memories' key.
    """

    settings: PowerSGDSettings = field(default_factory=PowerSGDSettings)
    iteration: int = 0
    errors: dict[int, Tensor] = field(default_factory=dict)
    q_memory: dict[int, Tensor] = field(default_factory=dict)
    parameter_index: dict[int, int] = field(default_factory=dict)

    def index_parameters(self, module: nn.Module) -> None:
        """Key the memories by each parameter's position in ``module.parameters()``."""
        self.parameter_index = {id(p): i for i, p in enumerate(module.parameters())}

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
        """The ``Q`` to multiply ``matrix`` with: the remembered one, or a seeded random one."""
        if key not in self.q_memory or not self.settings.warm_start:
            generator = torch.Generator().manual_seed(hash((self.settings.seed, key, self.iteration)) % 2**63)
            shape = (matrix.shape[1], min(self.settings.rank, *matrix.shape))
            self.q_memory[key] = torch.randn(shape, generator=generator).to(matrix.device, matrix.dtype)
        return self.q_memory[key]


def _bucket_views(bucket: dist.GradBucket) -> list[Tensor]:
    """One view into the bucket's flat buffer per parameter, in bucket order, shaped like its gradient."""
    buffer, views, offset = bucket.buffer(), [], 0
    for gradient in bucket.gradients():
        views.append(buffer[offset : offset + gradient.numel()].view(gradient.shape))
        offset += gradient.numel()
    return views


def _is_compressible(view: Tensor, rank: int) -> bool:
    if view.dim() < 2:
        return False
    rows, cols = view.shape[0], view[0].numel()
    return rows * cols > MIN_COMPRESSION_RATE * (rows + cols) * min(rank, rows, cols)


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


def _average_factors(state: PowerSGDState, factors: list[Tensor]) -> None:
    """Average ``factors`` over ranks in place, sent in the settings' ``factor_dtype``; waits for the result."""
    sent = _flatten(factors).to(POWERSGD_FACTOR_DTYPES[state.settings.factor_dtype])
    _unflatten_into(launch_mean_all_reduce(state, sent).wait(), factors)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Average one bucket with rank-``r`` PowerSGD compression (exact before ``start_iter``)."""
    is_last = bucket.is_last()
    if is_last:
        state.stats.finish_round()
    views = _bucket_views(bucket)
    compress = [_is_compressible(view, state.settings.rank) for view in views]
    if state.iteration < state.settings.start_iter or not any(compress):
        if is_last:
            state.iteration += 1
        return launch_mean_all_reduce(state, bucket.buffer())

    keys = [state.parameter_index[id(p)] for p, wanted in zip(bucket.parameters(), compress) if wanted]
    matrices = [view.view(view.shape[0], -1) for view, wanted in zip(views, compress) if wanted]
    exact = [view for view, wanted in zip(views, compress) if not wanted]
    exact_average = launch_mean_all_reduce(state, _flatten(exact)) if exact else None

    if state.settings.error_feedback:
        for key, matrix in zip(keys, matrices):
            if key in state.errors:
                matrix.add_(state.errors[key])
        compensated = [matrix.clone() for matrix in matrices]
    qs = [state.q_factor(key, matrix) for key, matrix in zip(keys, matrices)]
    ps = [matrix @ q for matrix, q in zip(matrices, qs)]
    # The P and Q rounds run in this (autograd) thread and wait: a collective launched
    # from a future's callback thread could interleave with the next bucket's in a
    # different order on each rank, which gloo and NCCL require to be identical.
    _average_factors(state, ps)
    for matrix, q, p in zip(matrices, qs, ps):
        _orthonormalise_columns(p)
        torch.matmul(matrix.t(), p, out=q)
    _average_factors(state, qs)
    for matrix, q, p in zip(matrices, qs, ps):
        torch.matmul(p, q.t(), out=matrix)
    if state.settings.error_feedback:
        for key, before, after in zip(keys, compensated, matrices):
            state.errors[key] = before.sub_(after)
    if is_last:
        state.iteration += 1
    if exact_average is None:
        done: Future[Tensor] = Future()
        done.set_result(bucket.buffer())
        return done
    return exact_average.then(lambda average: _unflatten_into(average.value(), exact) or bucket.buffer())
