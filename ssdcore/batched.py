"""Linear algebra written once for one matrix or a stack of M: the solo step's kernels and the
packed step's (:mod:`ssdcore.pack`) are the same functions.

A solo run's tensors are (m, n); a pack's are (M, m, n), run ``i`` in slice ``i``. The math is
written over tensors with an optional leading run axis (``...``, ``dim=-1``, ``.mT``); the few
operations whose kernel depends on the rank go through the helpers here, which keep each run's
result in a stack bit for bit its solo result on the CPU (``tests/test_pack.py``):

- :func:`matmul` / :func:`addmm`: ``mm`` / ``addmm`` for a matrix, ``bmm`` / ``baddbmm`` into an
  aligned stack for a stack;
- :func:`per_matrix` and :func:`mv`: run matrix by matrix where a batched call would differ in
  the last bit: full reductions (torch splits a large one across threads in its own way) and
  ``mv`` (a batched product with a vector takes another BLAS kernel);
- :func:`add_scaled_`, :func:`add_scaled_product_`, :func:`add_product_`: updates scaled by a
  number for a run and per-run values for a stack;
- :func:`stacked_empty`: run slices on 64-byte boundaries. BLAS kernels (MKL's gemv and gemm)
  take different code paths for outputs of different alignment, which changes the last bit; a
  solo run writes into freshly allocated (aligned) buffers, so each run's slice is padded to a
  64-byte multiple.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

ALIGNMENT_BYTES = 64


def stacked_empty(
    n_runs: int,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """An uninitialized (n_runs, *shape) tensor, each run's slice contiguous and 64-byte aligned
    (the rows of the run dimension are padded; the tensor itself is then not contiguous)."""
    per_run = math.prod(shape)
    quantum = max(1, ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())
    run_stride = -(-per_run // quantum) * quantum
    storage = torch.empty(max(1, n_runs * run_stride), dtype=dtype, device=device)
    strides, inner = [], 1
    for size in reversed(shape):
        strides.append(inner)
        inner *= size
    return storage.as_strided((n_runs, *shape), (run_stride, *reversed(strides)))


def stacked_copy(tensor: Tensor) -> Tensor:
    """An aligned copy of a stacked tensor."""
    shape, options = tuple(tensor.shape[1:]), {"dtype": tensor.dtype, "device": tensor.device}
    return stacked_empty(tensor.shape[0], shape, **options).copy_(tensor)


def over_rows(values: Tensor) -> Tensor:
    """Per-column values (a vector, or a stack's (M, n)) shaped to broadcast over the rows of a
    matrix (a stack's as (M, 1, n)); a vector broadcasts as it is."""
    return values if values.ndim < 2 else values.unsqueeze(-2)


def per_matrix_scalar(values: Tensor) -> Tensor:
    """One number per matrix (``()``, or a stack's ``(M,)``) shaped to broadcast over the
    matrices (a stack's as (M, 1, 1)); a single number broadcasts as it is."""
    return values if values.ndim == 0 else values[:, None, None]


def _product_out(left: Tensor, right: Tensor, dtype: torch.dtype) -> Tensor:
    shape = (left.shape[-2], right.shape[-1])
    return stacked_empty(left.shape[0], shape, dtype=dtype, device=left.device)


def matmul(left: Tensor, right: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``left @ right``: ``mm`` for matrices, ``bmm`` for stacks, into ``out`` or a fresh
    (aligned) result."""
    if left.ndim == 2:
        return left @ right if out is None else torch.mm(left, right, out=out)
    if out is None:
        out = _product_out(left, right, torch.promote_types(left.dtype, right.dtype))
    return torch.bmm(left, right, out=out)


def mv(matrix: Tensor, vector: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``matrix @ vector`` (one vector for every matrix of a stack), into ``out`` or a fresh
    (aligned) result. A stack's products run one ``mv`` per run: a batched product with a
    vector takes another BLAS kernel (gemm, not gemv) whose last-bit rounding differs at some
    sizes."""
    if matrix.ndim == 2:
        return torch.mv(matrix, vector, out=out)
    if out is None:
        shape = (matrix.shape[-2],)
        out = stacked_empty(matrix.shape[0], shape, dtype=matrix.dtype, device=matrix.device)
    for run, run_matrix in enumerate(matrix):
        torch.mv(run_matrix, vector, out=out[run])
    return out


def addmm(
    base: Tensor,
    left: Tensor,
    right: Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    out: Tensor | None = None,
) -> Tensor:
    """``beta·base + alpha·left @ right``: ``addmm`` for matrices, ``baddbmm`` for stacks, into
    ``out`` or a fresh (aligned) result."""
    if left.ndim == 2:
        return torch.addmm(base, left, right, beta=beta, alpha=alpha, out=out)
    if out is None:
        out = _product_out(left, right, left.dtype)
    return torch.baddbmm(base, left, right, beta=beta, alpha=alpha, out=out)


def per_matrix(function: Callable[..., Tensor], *tensors: Tensor, rank: int = 2) -> Tensor:
    """``function(*tensors)`` for single rank-``rank`` tensors; for stacks (one more leading
    dimension) the function run by run, results stacked. For what a batched call would not
    repeat bit for bit: full reductions and ``mv`` (see the module docstring)."""
    if tensors[0].ndim == rank:
        return function(*tensors)
    return torch.stack(
        [function(*parts) for parts in zip(*(t.unbind(0) for t in tensors), strict=True)]
    )


def add_scaled_(target: Tensor, tensor: Tensor, scale: float | Tensor) -> Tensor:
    """``target += scale·tensor``: ``scale`` a number (one run), or per-run values shaped to
    broadcast over a stack (``(M, 1)``, ``(M, 1, 1)``), each rounded to the tensors' dtype as
    the number is. The two forms give the same bits (``tests/test_pack.py``)."""
    if isinstance(scale, Tensor):
        return target.addcmul_(tensor, scale)
    return target.add_(tensor, alpha=scale)


def add_scaled_product_(
    target: Tensor, left: Tensor, right: Tensor, scale: float | Tensor
) -> Tensor:
    """``target += scale·left·right`` (elementwise), ``scale`` as in :func:`add_scaled_`."""
    if isinstance(scale, Tensor):
        return target.addcmul_(left * scale, right)
    return target.addcmul_(left, right, value=scale)


def add_product_(
    target: Tensor, left: Tensor, right: Tensor, alpha: float | Sequence[float]
) -> Tensor:
    """``target += alpha·left @ right``, ``alpha`` one number for a matrix or one per run of a
    stack. BLAS applies ``alpha`` inside the product, which no batched call with per-run values
    reproduces, so a stack's update runs as one ``addmm`` per run."""
    if target.ndim == 2:
        return target.addmm_(left, right, alpha=alpha)
    for run, run_alpha in enumerate(alpha):
        target[run].addmm_(left[run], right[run], alpha=run_alpha)
    return target
