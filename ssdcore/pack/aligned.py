"""Stacked per-run tensors whose run slices start on 64-byte boundaries.

Why: BLAS kernels (MKL's gemv and gemm on the CPU) take different code paths for output
buffers of different alignment, which changes the last bit of some results. A solo run
writes into freshly allocated (aligned) buffers; a pack's run ``i`` writes into slice ``i`` of
a stacked buffer, which starts ``i × (per-run size)`` elements in — misaligned unless that size
is a multiple of the alignment. Padding each run's slice to a 64-byte multiple puts every run's
outputs at the same alignment as the solo run's, so packed results equal solo results bit for
bit (``tests/test_pack.py``), whatever the model's shape.
"""

from __future__ import annotations

import math

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


def stacked_like(tensor: Tensor) -> Tensor:
    """:func:`stacked_empty` of ``tensor``'s shape, dtype and device."""
    return stacked_empty(
        tensor.shape[0], tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )


def stacked_copy(tensor: Tensor) -> Tensor:
    """An aligned copy of a stacked tensor."""
    return stacked_like(tensor).copy_(tensor)


def bmm(left: Tensor, right: Tensor) -> Tensor:
    """``left @ right`` per run, into a fresh aligned stack (see the module docstring)."""
    out = stacked_empty(
        left.shape[0],
        (left.shape[1], right.shape[2]),
        dtype=torch.promote_types(left.dtype, right.dtype),
        device=left.device,
    )
    return torch.bmm(left, right, out=out)


def baddbmm(
    base: Tensor, left: Tensor, right: Tensor, *, beta: float = 1.0, alpha: float = 1.0
) -> Tensor:
    """``beta·base + alpha·left @ right`` per run, into a fresh aligned stack."""
    out = stacked_empty(
        left.shape[0], (left.shape[1], right.shape[2]), dtype=left.dtype, device=left.device
    )
    return torch.baddbmm(base, left, right, beta=beta, alpha=alpha, out=out)
