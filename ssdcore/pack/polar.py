"""The spectral step's polar factor ``U Vᵀ`` and nuclear norm ``‖σ(G)‖₁`` for a stack of M
gradients (M, m, n): :mod:`ssdcore.optim.polar` with a leading run dimension.

- :func:`packed_gram_factors` — exact, as :func:`~ssdcore.optim.polar.polar_gram_factors`: the
  float64 Gram matrix of each gradient on its short side, a batched ``eigh``, ``U Vᵀ = G S``
  with ``S = Q Λ^{-1/2} Qᵀ`` over the kept eigenvalues; same thresholds, per run.
- :func:`packed_newton_schulz` / :func:`packed_newton_schulz_factors` — the quintic
  Newton–Schulz iteration, dense or in the factors' r×r space, batched products only.
- :func:`packed_svd` — the reference, batched ``torch.linalg.svd``.

A run whose gradient is not finite gets a NaN nuclear norm (its step then turns its parameters
non-finite, which the pack's divergence check catches) instead of failing the batched ``eigh``
for every run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdcore.optim.polar import CONVERGENT_QUINTIC, MUON_QUINTIC
from ssdcore.optim.threads import one_cpu_thread
from ssdcore.pack.aligned import baddbmm, bmm, stacked_copy, stacked_empty


def _finite_runs(stack: Tensor) -> Tensor:
    """(M,) True where every entry of that run's matrix is finite."""
    return torch.isfinite(stack).flatten(1).all(dim=1)


def _inverse_square_root(
    gram: Tensor, shape: tuple[int, int], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Per run ``(S, ‖σ‖₁)`` from float64 Gram matrices (M, k, k); see the solo
    ``_inverse_square_root`` in :mod:`ssdcore.optim.polar` (same thresholds, per run)."""
    finite = _finite_runs(gram)
    identity = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    safe_gram = torch.where(finite.view(-1, 1, 1), gram, identity)
    eigenvalues, vectors = _eigh_per_run(safe_gram)  # (M, k), (M, k, k)
    largest = eigenvalues.amax(dim=-1, keepdim=True)
    kept = eigenvalues > (max(shape) * torch.finfo(dtype).eps) ** 2 * largest
    noise = max(shape) * torch.finfo(eigenvalues.dtype).eps * largest
    nuclear_norm = torch.where(eigenvalues <= noise, 0.0, eigenvalues).sqrt().sum(dim=-1)
    nuclear_norm = torch.where(finite, nuclear_norm, torch.nan)
    inverse_root = torch.where(kept, torch.where(kept, eigenvalues, 1.0).rsqrt(), 0.0)
    return bmm(vectors * inverse_root.unsqueeze(1), vectors.mT), nuclear_norm


def _eigh_per_run(gram: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of each run's matrix, as one batched call: LAPACK runs per matrix
    on its own copy either way, so each result equals the solo step's bit for bit
    (``tests/test_pack.py``), and one call saves the per-call overhead (3x at 32 × 16×16)."""
    return torch.linalg.eigh(gram)


def packed_gram_factors(grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Exact polar factors of (M, m, n) float32 gradients: ``(left, right, ‖σ‖₁ (M,))`` with
    ``U Vᵀ = left @ right`` — ``(G, S)`` for tall G, ``(S, G)`` for wide G."""
    shape = (grad.shape[-2], grad.shape[-1])
    wide = shape[0] < shape[1]
    g64 = stacked_empty(grad.shape[0], shape, dtype=torch.float64, device=grad.device)
    g64.copy_(grad)
    gram = bmm(g64, g64.mT) if wide else bmm(g64.mT, g64)  # (M, min, min)
    with one_cpu_thread(grad.device):
        inverse_root, nuclear_norm = _inverse_square_root(gram, shape, grad.dtype)
    inverse_root = stacked_copy(inverse_root.to(grad.dtype))
    nuclear_norm = nuclear_norm.to(grad.dtype)
    if wide:
        return inverse_root, grad, nuclear_norm
    return grad, inverse_root, nuclear_norm


def packed_svd(grad: Tensor) -> tuple[Tensor, Tensor]:
    """Reference ``(U Vᵀ (M, m, n), ‖σ‖₁ (M,))`` from a batched SVD, numerical range only."""
    u, s, vh = torch.linalg.svd(grad, full_matrices=False)
    tolerance = s.amax(dim=-1, keepdim=True) * max(grad.shape[-2:]) * torch.finfo(s.dtype).eps
    return bmm(u * (s > tolerance).unsqueeze(1), vh), s.sum(dim=-1)


def _coefficients(fast_steps: int, polish_steps: int) -> list[tuple[float, ...]]:
    return [MUON_QUINTIC] * fast_steps + [CONVERGENT_QUINTIC] * polish_steps


def packed_newton_schulz(
    grad: Tensor, *, fast_steps: int = 5, polish_steps: int = 3
) -> tuple[Tensor, Tensor]:
    """``(U Vᵀ, ‖σ‖₁)`` per run by the solo quintic Newton–Schulz iteration
    (:func:`~ssdcore.optim.polar.polar_newton_schulz`), on the short side's Gram matrix."""
    transposed = grad.shape[-2] > grad.shape[-1]
    x = grad.mT if transposed else grad
    runs = range(grad.shape[0])
    # Both full reductions run per run: torch splits one large reduction across threads in
    # its own way, so a batched sum over (-2, -1) of a 784×64 matrix differs from the solo sum
    # in the last bit on two threads (tests/test_pack_rules.py).
    norm = torch.stack([torch.linalg.vector_norm(x[run]) for run in runs]).view(-1, 1, 1)
    x = x / norm.clamp_min(torch.finfo(grad.dtype).tiny)
    for a, b, c in _coefficients(fast_steps, polish_steps):
        gram = bmm(x, x.mT)
        x = baddbmm(x, baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    direction = x.mT if transposed else x
    return direction, torch.stack([(grad[run] * direction[run]).sum() for run in runs])


def packed_newton_schulz_factors(
    left: Tensor, right: Tensor, *, fast_steps: int = 5, polish_steps: int = 3
) -> tuple[Tensor, Tensor, Tensor]:
    """Newton–Schulz of ``G = left @ right`` in the r×r factor space, per run (see
    :func:`~ssdcore.optim.polar.polar_newton_schulz_factors`): ``(left, Y @ right, ‖σ‖₁)``."""
    q = bmm(left.mT, left)  # (M, r, r)
    p = bmm(right, right.mT)  # (M, r, r)
    frobenius = (q * p).sum(dim=(-2, -1), keepdim=True).sqrt()
    frobenius = frobenius.clamp_min(torch.finfo(left.dtype).tiny)
    eye = torch.eye(q.shape[-1], dtype=left.dtype, device=left.device)
    y = eye / frobenius
    for a, b, c in _coefficients(fast_steps, polish_steps):
        z = bmm(bmm(bmm(y, p), y.mT), q)
        y = baddbmm(y, baddbmm(z, z, z, beta=b, alpha=c), y, beta=a)
    nuclear_norm = (bmm(q, y) * p).sum(dim=(-2, -1))
    return left, bmm(y, right), nuclear_norm
